-- A customer's usage of a voucher is counted from the reservation rows (DESIGN §3, per-customer
-- limit), as on SQLite: `customer_usage` becomes a view of them. The table it replaces cost every
-- new reservation a heap row and an index entry of its own (about a third of PostgreSQL's CPU
-- per reservation in the merged commit: 36-38 -> 27-29 µs per row at 64 rows a call, measured
-- with pgbench), and every release and expiry an update of it.
--
-- What the usage rows also did, serialise two transactions that decide for the same customer of
-- the same voucher, the merged commit now does with a transaction-level advisory lock per
-- (voucher, customer) (migration 2): no row, no WAL; held to commit.
--
-- The order of the steps is what keeps this migration out of deadlocks with nodes of the build
-- before it that are still serving: their commits lock usage rows, then write reservations;
-- their releases and expiries lock reservation rows, then write usage. So this
-- migration takes one table's exclusive lock only: it drops `customer_usage` first (waiting
-- for the transactions in flight on it), then builds the index with the lock that blocks only
-- writes, which those transactions' reservation-row locks do not conflict with. The index by
-- (voucher, status) that this one replaces is dropped after the migration's transaction, with
-- `DROP INDEX CONCURRENTLY` (src/ledger/postgres/open.rs, `drop_after_migration`): dropping it
-- here would take that table's exclusive lock too.
DROP TABLE IF EXISTS customer_usage;
CREATE OR REPLACE VIEW customer_usage AS
    SELECT voucher_code, customer_id, count(*)::BIGINT AS used
    FROM reservations WHERE status IN ('RESERVED', 'CONFIRMED')
    GROUP BY voucher_code, customer_id;

-- One index serves both the usage count (voucher, customer) and the per-voucher reads the old
-- index served (the reconciliation's counts by status read the voucher's range of it). Its build
-- reads every reservation and blocks their writes meanwhile: no statement deadline for it (lock
-- waits keep theirs).
SET LOCAL statement_timeout = 0;
CREATE INDEX IF NOT EXISTS reservations_by_customer
    ON reservations (voucher_code, customer_id, status);
