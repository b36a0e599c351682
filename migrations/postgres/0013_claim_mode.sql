-- How the directory keeps the order rule across shards (docs/DESIGN.md, "Shards"); only the
-- first shard's row is used. 'off': nodes store orders without claims (one shard, or
-- `ledger.order_ids_across_shards = false`). 'filling': claims have begun, and the orders the
-- shards stored without them are being copied into `order_claims` (a node that starts while
-- it says so copies them again before it serves: the copy is idempotent). 'on': every stored
-- order is claimed. Nodes that started 'off' read it at every beat and stop committing once
-- it is not; a node that would store without claims is refused while it is not 'off'.
CREATE TABLE IF NOT EXISTS order_claim_mode (
    id   INT  PRIMARY KEY CHECK (id = 1),
    mode TEXT NOT NULL CHECK (mode IN ('off', 'filling', 'on'))
);

-- Per shard: order claims have begun (the row is there). The node that copies this shard's
-- orders into the claims inserts it first, holding an advisory lock alone; every commit of a
-- node that does not claim its orders (vouchers_commit_batches_v2 called directly: a single
-- ledger's node, a node of an older build, a sharded node without claims) takes that lock
-- shared and is refused once the row is there. So no order stored without a claim lands on a
-- shard after the copy of its orders began: a fence, not a wait, and closed by default.
CREATE TABLE IF NOT EXISTS claims_begun (
    id INT PRIMARY KEY CHECK (id = 1)
);

-- The merged commit of a node that claims its orders on the directory first: past the fence.
CREATE OR REPLACE FUNCTION vouchers_commit_batches_claimed(
    p_lease    BIGINT[],
    p_code     TEXT[],
    p_now      BIGINT[],
    p_expires  BIGINT[],
    p_batch    INT[],
    p_order    TEXT[],
    p_customer BIGINT[]
) RETURNS TABLE (
    out_idx      INT,
    out_verdict  TEXT,
    out_discount BIGINT,
    out_voucher  TEXT,
    out_customer BIGINT,
    out_status   TEXT,
    out_expires  BIGINT
)
LANGUAGE plpgsql AS $$
BEGIN
    -- For this transaction only (the call is its own).
    PERFORM set_config('vouchers.claimed', 'on', true);
    RETURN QUERY SELECT * FROM vouchers_commit_batches_v2(
        p_lease, p_code, p_now, p_expires, p_batch, p_order, p_customer);
END
$$;
