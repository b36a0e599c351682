-- The change feed (DESIGN §6, `GET /admin/events`). `feed_head.last` is the last sequence
-- number handed out. Every transaction that changes reservations locks it as the last lock it
-- takes and holds it to commit: numbers are gap-free (a rollback takes its numbers back) and
-- follow commit order, so a reader never sees a number before every smaller one.
--
-- No row is added per reservation:
--   - a merged commit's new reservations (RESERVED events) take consecutive numbers as one
--     `feed_batches` row per transaction: its last number and its order ids, in order;
--   - a reservation changes state at most once more (CONFIRMED, RELEASED or EXPIRED), and that
--     event's number lives on its own row (`settled_seq`), written with its new status.
CREATE TABLE IF NOT EXISTS feed_head (
    id     INT PRIMARY KEY CHECK (id = 1),
    last   BIGINT NOT NULL CHECK (last >= 0),
    -- This ledger's feed, among others: a copy of the feed (the Redis Stream) made from another
    -- ledger is never taken for this one's.
    origin TEXT   NOT NULL
);
CREATE TABLE IF NOT EXISTS feed_batches (
    last_seq BIGINT PRIMARY KEY,
    orders   TEXT[] NOT NULL CHECK (cardinality(orders) > 0)
);
ALTER TABLE reservations ADD COLUMN IF NOT EXISTS settled_seq BIGINT;
-- Released by the expiry sweep rather than by its customer.
ALTER TABLE reservations ADD COLUMN IF NOT EXISTS expired BOOLEAN NOT NULL DEFAULT false;

-- Reservations made before the feed existed are numbered once, by time: every RESERVED first
-- (in feed batches of 1000), then every later change.
INSERT INTO feed_batches (last_seq, orders)
SELECT max(n), array_agg(order_id ORDER BY n)
FROM (SELECT order_id, row_number() OVER (ORDER BY created_at, order_id) AS n FROM reservations) x
GROUP BY (n - 1) / 1000;
UPDATE reservations x SET
    settled_seq = (SELECT count(*) FROM reservations) + r.n,
    expired = (x.status = 'RELEASED' AND x.updated_at >= x.expires_at)
FROM (SELECT order_id, row_number() OVER (ORDER BY updated_at, order_id) AS n
      FROM reservations WHERE status <> 'RESERVED') r
WHERE x.order_id = r.order_id;
INSERT INTO feed_head (id, origin, last)
SELECT 1, substr(md5(random()::text || clock_timestamp()::text), 1, 16), GREATEST((SELECT count(*) FROM reservations),
                   (SELECT COALESCE(max(settled_seq), 0) FROM reservations))
ON CONFLICT (id) DO NOTHING;
CREATE UNIQUE INDEX IF NOT EXISTS reservations_by_settled_seq ON reservations (settled_seq)
    WHERE settled_seq IS NOT NULL;

-- Writers of an older build leave their changes out of the feed; they fail loudly instead:
-- their inserts do not set `fed`, and their status changes do not set `settled_seq`. (Builds
-- from this one on also refuse to start on a schema newer than they know.)
ALTER TABLE reservations ADD COLUMN IF NOT EXISTS fed BOOLEAN NOT NULL DEFAULT true;
ALTER TABLE reservations ALTER COLUMN fed DROP DEFAULT;
ALTER TABLE reservations ADD CONSTRAINT reservations_settled_numbered
    CHECK (status = 'RESERVED' OR settled_seq IS NOT NULL);
DROP FUNCTION IF EXISTS vouchers_commit_batches(BIGINT[], TEXT[], BIGINT[], BIGINT[], INT[], TEXT[], BIGINT[]);
