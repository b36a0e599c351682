-- The ledger in shards (docs/DESIGN.md, "Shards"). Every shard has these tables; only the
-- first shard's (the directory's) are used.
--
-- Which shard holds each voucher: chosen when it is created, never by a hash of the code, so
-- that adding a shard moves no voucher. `epoch` counts the voucher's moves (none yet): a move
-- can come later without a new format.
-- `placed_at` (the placing node's clock) lets a node read the codes placed since its last read
-- from the directory alone, whatever shard is down.
CREATE TABLE IF NOT EXISTS voucher_shards (
    code      TEXT   PRIMARY KEY,
    shard     INT    NOT NULL CHECK (shard >= 0),
    epoch     BIGINT NOT NULL DEFAULT 1 CHECK (epoch >= 1),
    placed_at BIGINT NOT NULL
);
CREATE INDEX IF NOT EXISTS voucher_shards_by_placed ON voucher_shards (placed_at);
-- Vouchers placed on each shard: a new voucher goes to the shard with the fewest.
CREATE TABLE IF NOT EXISTS shard_room (
    shard    INT    PRIMARY KEY CHECK (shard >= 0),
    vouchers BIGINT NOT NULL DEFAULT 0
);
-- The change feed of every shard, merged: numbered again here without gaps, in the order the
-- merge copied them; `feed_merge_heads` holds, per shard, the last of its own numbers copied,
-- written in the same transaction as the copies (each event is copied once).
CREATE TABLE IF NOT EXISTS feed_merged (
    seq          BIGINT PRIMARY KEY CHECK (seq > 0),
    shard        INT    NOT NULL,
    kind         TEXT   NOT NULL,
    voucher_code TEXT   NOT NULL,
    order_id     TEXT   NOT NULL,
    customer_id  BIGINT NOT NULL,
    at           BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS feed_merge_heads (
    shard INT    PRIMARY KEY,
    last  BIGINT NOT NULL CHECK (last >= 0)
);
-- Which shard this database is, of which directory (the first shard's feed origin): a list of
-- shards given in another order, or a database of another cluster, is refused at start.
CREATE TABLE IF NOT EXISTS shard_self (
    id        INT  PRIMARY KEY CHECK (id = 1),
    shard     INT  NOT NULL CHECK (shard >= 0),
    directory TEXT NOT NULL
);
-- An order id is used on one voucher only (DESIGN §4), across shards: the first commit that
-- carries it claims it for its voucher here, before its shard's transaction. `pending` counts
-- the calls that carried it to that voucher's shard and did not come back refused: a call
-- whose row was stored (or may have been: a lost answer, a crash) never gives its count back,
-- so such a claim stays for good; one whose rows were all refused gives it back, and a claim
-- back at zero goes away, so an order refused on one voucher may try another.
-- Order ids compare bytewise ("C"), as the callers sort them, whatever the database's
-- collation: every statement locks claims in the same order, so none waits on another.
CREATE TABLE IF NOT EXISTS order_claims (
    order_id TEXT COLLATE "C" PRIMARY KEY,
    code     TEXT   NOT NULL,
    pending  BIGINT NOT NULL CHECK (pending >= 0)
);
-- Gives back one count of each of `p_orders` (distinct; each carried by the calling commit and
-- refused), locked in order-id order as every caller takes them; drops those back at zero.
CREATE OR REPLACE FUNCTION vouchers_release_claims(p_orders TEXT[]) RETURNS VOID
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM 1 FROM order_claims WHERE order_id = ANY(p_orders) ORDER BY order_id FOR UPDATE;
    UPDATE order_claims SET pending = pending - 1
        WHERE order_id = ANY(p_orders) AND pending > 0;
    DELETE FROM order_claims WHERE order_id = ANY(p_orders) AND pending = 0;
END
$$;
