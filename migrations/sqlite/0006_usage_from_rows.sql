-- A customer's usage of a voucher (DESIGN §3, the per-user limit) is the number of their
-- reservations of it that are not RELEASED, counted from the reservations themselves through
-- `reservations_by_customer` (as `status IN ('RESERVED', 'CONFIRMED')`, which the index seeks;
-- `<> 'RELEASED'` would walk the customer's released rows too). The embedded ledger has one
-- writer, so nothing can come between that count and the insert it decides; a separate
-- `customer_usage` table only kept a second copy,
-- and with many vouchers hot at once every merged commit wrote one more B-tree page per voucher
-- (and its checkpoint wrote it again) to keep it.
--
-- The new index also serves every per-voucher read `reservations_by_voucher` served (its
-- leading column is the voucher). `customer_usage` stays as a view, for the auditor and for
-- operators' queries: `used` is the same number the table held.
CREATE INDEX IF NOT EXISTS reservations_by_customer
    ON reservations (voucher_code, customer_id, status);
DROP INDEX IF EXISTS reservations_by_voucher;
DROP TABLE IF EXISTS customer_usage;
CREATE VIEW IF NOT EXISTS customer_usage AS
    SELECT voucher_code, customer_id, COUNT(*) AS used FROM reservations
    WHERE status IN ('RESERVED', 'CONFIRMED') GROUP BY voucher_code, customer_id;
