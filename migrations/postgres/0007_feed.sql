-- The change feed (DESIGN §6, `GET /admin/events`). A reservation changes state at most twice
-- (RESERVED, then CONFIRMED, RELEASED or EXPIRED), so its two events live on its own row: the
-- feed costs no row beyond the one durability writes anyway. `feed_head.last` is the last
-- sequence number handed out. Every transaction that changes reservations locks it as the last
-- lock it takes and holds it to commit: numbers are gap-free (a rollback takes its numbers back)
-- and follow commit order, so a reader never sees a number before every smaller one.
ALTER TABLE reservations ADD COLUMN IF NOT EXISTS reserved_seq BIGINT;
ALTER TABLE reservations ADD COLUMN IF NOT EXISTS settled_seq BIGINT;
-- Released by the expiry sweep rather than by its customer.
ALTER TABLE reservations ADD COLUMN IF NOT EXISTS expired BOOLEAN NOT NULL DEFAULT false;

CREATE TABLE IF NOT EXISTS feed_head (
    id   INT PRIMARY KEY CHECK (id = 1),
    last BIGINT NOT NULL CHECK (last >= 0)
);

-- Reservations made before the feed existed are numbered once, by time: every RESERVED first,
-- then every later change.
UPDATE reservations x SET reserved_seq = r.n
FROM (SELECT order_id, row_number() OVER (ORDER BY created_at, order_id) AS n FROM reservations) r
WHERE x.order_id = r.order_id;
UPDATE reservations x SET
    settled_seq = (SELECT count(*) FROM reservations) + r.n,
    expired = (x.status = 'RELEASED' AND x.updated_at >= x.expires_at)
FROM (SELECT order_id, row_number() OVER (ORDER BY updated_at, order_id) AS n
      FROM reservations WHERE status <> 'RESERVED') r
WHERE x.order_id = r.order_id;
INSERT INTO feed_head (id, last)
SELECT 1, COALESCE(GREATEST(max(reserved_seq), max(settled_seq)), 0) FROM reservations
ON CONFLICT (id) DO NOTHING;

-- From now on every reservation is numbered when it is written: a writer that does not number
-- it (an older build's commit function) fails loudly instead of leaving it out of the feed.
-- (Builds from this one on also refuse to start on a schema newer than they know.)
ALTER TABLE reservations ALTER COLUMN reserved_seq SET NOT NULL;

CREATE UNIQUE INDEX IF NOT EXISTS reservations_by_reserved_seq ON reservations (reserved_seq);
CREATE UNIQUE INDEX IF NOT EXISTS reservations_by_settled_seq ON reservations (settled_seq)
    WHERE settled_seq IS NOT NULL;
