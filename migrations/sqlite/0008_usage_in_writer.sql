-- Each customer's usage of a voucher is counted by the ledger's writer, in memory, from the
-- rows (src/ledger/sqlite_usage.rs), instead of read off an index on (voucher, customer,
-- status). With a real sale's customers, who come in no order, that index took every new
-- reservation on a random leaf page, and on SQLite every page a commit dirties is a
-- write-ahead-log frame of its own. The index that replaces it takes a voucher's new rows at the
-- end of its RESERVED range (rowids rise), and still serves what reads by voucher and status:
-- the books' counts, the winners' list, loading a voucher's usage.
-- The build before this one refuses a ledger at this version. To go back to it by hand:
--   CREATE INDEX reservations_by_customer ON reservations (voucher_code, customer_id, status);
--   DELETE FROM schema_migrations WHERE version = 8;
DROP INDEX IF EXISTS reservations_by_customer;
CREATE INDEX IF NOT EXISTS reservations_by_voucher ON reservations (voucher_code, status);
