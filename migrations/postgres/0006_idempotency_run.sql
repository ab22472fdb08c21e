-- The server run (one start of a server) that answers a keyed request still
-- in progress, while nothing its request made would be made twice by a
-- retry. A retry may take over a key whose run has ended (the server was
-- killed or restarted): a key does not stay in progress for a day after a
-- crash. Null once a transaction of the request created a record (a lease,
-- a process, a port reservation), and in rows made before this column: a
-- retry must not create it again, and the key stays held.
ALTER TABLE idempotency ADD COLUMN run_id TEXT;
