-- Liveness of lease holders (DESIGN §3, "Reap"): each process is an incarnation of its node name
-- and holds leases as `name#incarnation`. The embedded ledger has one process (a file lock sees
-- to it), so this only keeps both ledgers alike: the conformance suite runs on both.
CREATE TABLE IF NOT EXISTS node_names (
    name             TEXT PRIMARY KEY,
    last_incarnation INTEGER NOT NULL CHECK (last_incarnation >= 1)
);

CREATE TABLE IF NOT EXISTS nodes (
    holder      TEXT PRIMARY KEY,
    name        TEXT    NOT NULL,
    incarnation INTEGER NOT NULL,
    started_at  INTEGER NOT NULL,
    beat_at     INTEGER NOT NULL,
    streak_from INTEGER NOT NULL,
    dead_after  INTEGER NOT NULL CHECK (dead_after > 0)
);

CREATE INDEX IF NOT EXISTS leases_active_by_node ON leases (node_id) WHERE state = 'ACTIVE';
