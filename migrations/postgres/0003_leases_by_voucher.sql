-- A sold-out probe sums `consumed` over every lease of its voucher (how many reservations the
-- voucher ever had), not only the active ones: index them all by voucher.
CREATE INDEX IF NOT EXISTS leases_by_voucher ON leases (voucher_code);
