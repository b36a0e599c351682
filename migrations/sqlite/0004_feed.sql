-- The change feed (DESIGN §6, `GET /admin/events`). A reservation changes state at most twice
-- (RESERVED, then CONFIRMED, RELEASED or EXPIRED), so its two events live on its own row: the
-- feed costs no row beyond the one durability writes anyway. `feed_head.last` is the last
-- sequence number handed out; every transaction that changes reservations takes its numbers
-- from it, so the numbers are gap-free and follow commit order.
ALTER TABLE reservations ADD COLUMN reserved_seq INTEGER;
ALTER TABLE reservations ADD COLUMN settled_seq INTEGER;
-- Released by the expiry sweep rather than by its customer.
ALTER TABLE reservations ADD COLUMN expired INTEGER NOT NULL DEFAULT 0 CHECK (expired IN (0, 1));

CREATE TABLE IF NOT EXISTS feed_head (
    id     INTEGER PRIMARY KEY CHECK (id = 1),
    last   INTEGER NOT NULL CHECK (last >= 0),
    -- This ledger's feed, among others: a copy of the feed (the Redis Stream) made from another
    -- ledger is never taken for this one's.
    origin TEXT    NOT NULL
);

-- Reservations made before the feed existed are numbered once, by time: every RESERVED first,
-- then every later change.
UPDATE reservations SET reserved_seq = r.n
FROM (SELECT order_id, ROW_NUMBER() OVER (ORDER BY created_at, order_id) AS n FROM reservations) AS r
WHERE reservations.order_id = r.order_id;
UPDATE reservations SET
    settled_seq = (SELECT COUNT(*) FROM reservations) + r.n,
    expired = CASE WHEN reservations.status = 'RELEASED' AND reservations.updated_at >= reservations.expires_at
                   THEN 1 ELSE 0 END
FROM (SELECT order_id, ROW_NUMBER() OVER (ORDER BY updated_at, order_id) AS n
      FROM reservations WHERE status <> 'RESERVED') AS r
WHERE reservations.order_id = r.order_id;
INSERT OR IGNORE INTO feed_head (id, origin, last)
SELECT 1, lower(hex(randomblob(8))), COALESCE(MAX(MAX(COALESCE(reserved_seq, 0)), MAX(COALESCE(settled_seq, 0))), 0) FROM reservations;

CREATE UNIQUE INDEX IF NOT EXISTS reservations_by_reserved_seq ON reservations (reserved_seq);
CREATE UNIQUE INDEX IF NOT EXISTS reservations_by_settled_seq ON reservations (settled_seq)
    WHERE settled_seq IS NOT NULL;
