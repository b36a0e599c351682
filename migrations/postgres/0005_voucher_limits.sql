-- A voucher's own rate limits (DESIGN §6). NULL: the node's configured default; 0: off.
ALTER TABLE vouchers ADD COLUMN IF NOT EXISTS customer_rate INTEGER CHECK (customer_rate >= 0);
ALTER TABLE vouchers ADD COLUMN IF NOT EXISTS customer_burst INTEGER CHECK (customer_burst >= 0);
ALTER TABLE vouchers ADD COLUMN IF NOT EXISTS admission_rate INTEGER CHECK (admission_rate >= 0);
