-- Placement spreads a burst of creates over the shards (docs/DESIGN.md, "Shards"). With only
-- `vouchers`, a shard just added, or back from an outage (placement passes over a shard that
-- is down), took every new voucher until it had caught up: a whole campaign created at once,
-- the vouchers about to be hot, all on one shard.
--
-- `recent` counts the vouchers placed on a shard lately, halving every 10 minutes from
-- `recent_at` (the directory's own clock, ms). A new voucher goes to the shard with the fewest
-- recent placements, counted in steps of eight, and among those to the one with the fewest
-- vouchers: a burst goes round the shards eight at a time, the emptiest first, and a trickle
-- still fills the emptiest shard.
--
-- Applied at every start, not as a numbered migration: the columns only add to `shard_room`,
-- and a node of an earlier build (which places by `vouchers` alone) keeps working beside them,
-- so a rollout or a rollback needs no step of its own. The catalogue is read first, so that a
-- start takes no lock on the table once the columns are there.
DO $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM information_schema.columns
                   WHERE table_schema = current_schema() AND table_name = 'shard_room'
                     AND column_name = 'recent_at') THEN
        ALTER TABLE shard_room ADD COLUMN IF NOT EXISTS recent DOUBLE PRECISION NOT NULL DEFAULT 0;
        ALTER TABLE shard_room ADD COLUMN IF NOT EXISTS recent_at BIGINT NOT NULL DEFAULT 0;
    END IF;
END
$$;
