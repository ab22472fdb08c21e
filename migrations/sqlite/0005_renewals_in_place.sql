-- A renewal sets expires_at, and an index of it made each renewal, and each
-- acquire and release, write one more page. The reconciler's search for
-- expired leases goes through the current ones (leases_one_current), which
-- are few; nothing else searched by expiry.
DROP INDEX leases_current_expiry;
