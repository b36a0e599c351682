-- Ledger schema, PostgreSQL flavour. Times are milliseconds since the Unix epoch.
-- The CHECK constraints are the last line of defence of DESIGN §3.
--
-- Batches of different nodes must not queue behind one row, so the voucher row carries no
-- per-batch counter here: units a batch takes are counted on the node's own lease (`consumed`),
-- and `reserved` is derived: Σ leases.consumed − confirmed − released. What bounds the sale is
-- `free >= 0` (grants take units off `free` under the voucher row lock) and
-- `consumed <= granted` on every lease.

CREATE TABLE IF NOT EXISTS vouchers (
    code             TEXT PRIMARY KEY,
    discount_amount  BIGINT NOT NULL CHECK (discount_amount >= 0),
    min_order_amount BIGINT NOT NULL CHECK (min_order_amount >= 0),
    total_limit      BIGINT NOT NULL CHECK (total_limit >= 0),
    per_user_limit   BIGINT NOT NULL CHECK (per_user_limit >= 1),
    starts_at        BIGINT NOT NULL,
    ends_at          BIGINT NOT NULL,
    status           TEXT   NOT NULL CHECK (status IN ('ACTIVE', 'PAUSED')),
    free             BIGINT NOT NULL CHECK (free >= 0),
    confirmed        BIGINT NOT NULL DEFAULT 0 CHECK (confirmed >= 0),
    released         BIGINT NOT NULL DEFAULT 0 CHECK (released >= 0),
    created_at       BIGINT NOT NULL,
    CHECK (free + confirmed <= total_limit),
    CHECK (starts_at < ends_at)
);

CREATE TABLE IF NOT EXISTS leases (
    id           BIGSERIAL PRIMARY KEY,
    voucher_code TEXT   NOT NULL REFERENCES vouchers (code),
    node_id      TEXT   NOT NULL,
    granted      BIGINT NOT NULL CHECK (granted > 0),
    consumed     BIGINT NOT NULL DEFAULT 0,
    state        TEXT   NOT NULL CHECK (state IN ('ACTIVE', 'RETURNED', 'REAPED')),
    granted_at   BIGINT NOT NULL,
    expires_at   BIGINT NOT NULL,
    closed_at    BIGINT,
    CHECK (consumed >= 0 AND consumed <= granted)
);
CREATE INDEX IF NOT EXISTS leases_active_by_voucher ON leases (voucher_code) WHERE state = 'ACTIVE';
CREATE INDEX IF NOT EXISTS leases_active_by_expiry ON leases (expires_at) WHERE state = 'ACTIVE';

-- The two hot tables carry no foreign keys: a batch writes them only while it holds its voucher
-- (and lease) in the same transaction, and per-row foreign-key checks would cost more than the
-- batch itself.
CREATE TABLE IF NOT EXISTS reservations (
    order_id        TEXT PRIMARY KEY,
    voucher_code    TEXT   NOT NULL,
    customer_id     BIGINT NOT NULL CHECK (customer_id > 0),
    lease_id        BIGINT NOT NULL,
    discount_amount BIGINT NOT NULL,
    status          TEXT   NOT NULL CHECK (status IN ('RESERVED', 'CONFIRMED', 'RELEASED')),
    created_at      BIGINT NOT NULL,
    expires_at      BIGINT NOT NULL,
    updated_at      BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS reservations_by_voucher ON reservations (voucher_code, status);
CREATE INDEX IF NOT EXISTS reservations_due ON reservations (expires_at) WHERE status = 'RESERVED';

CREATE TABLE IF NOT EXISTS customer_usage (
    voucher_code TEXT   NOT NULL,
    customer_id  BIGINT NOT NULL,
    used         BIGINT NOT NULL CHECK (used >= 0),
    PRIMARY KEY (voucher_code, customer_id)
);
