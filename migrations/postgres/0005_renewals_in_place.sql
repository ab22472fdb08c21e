-- A renewal sets expires_at. While an index holds that column PostgreSQL
-- cannot update the row in place (a HOT update): each renewal wrote a new
-- entry in every index of leases, and left as many dead ones for VACUUM.
-- The reconciler's search for expired leases goes through the current ones
-- (leases_one_current), which are few; nothing else searched by expiry.
DROP INDEX leases_current_expiry;
