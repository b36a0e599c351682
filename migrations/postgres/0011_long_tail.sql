-- The long tail (DESIGN §8): a catalogue of many vouchers, few of them busy.
-- Vouchers an operator watches: their live numbers are exported whatever their traffic.
CREATE TABLE IF NOT EXISTS watched_vouchers (
    code TEXT PRIMARY KEY REFERENCES vouchers (code)
);
-- A node that misses a code reads only the codes created since its last read, not all of them.
CREATE INDEX IF NOT EXISTS vouchers_by_created ON vouchers (created_at);
