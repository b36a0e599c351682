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
