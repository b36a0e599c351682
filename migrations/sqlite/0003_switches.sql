-- Emergency switches (DESIGN §6): one row, read by every node at least once a second.
CREATE TABLE IF NOT EXISTS switches (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    sales_paused INTEGER NOT NULL DEFAULT 0 CHECK (sales_paused IN (0, 1)),
    read_only    INTEGER NOT NULL DEFAULT 0 CHECK (read_only IN (0, 1)),
    updated_at   INTEGER NOT NULL DEFAULT 0,
    -- Bumped by every change: a node applies a read only if it is not older than what it holds.
    version      INTEGER NOT NULL DEFAULT 0
);
INSERT OR IGNORE INTO switches (id) VALUES (1);

-- Pre-heat looks for vouchers about to start every second on every node.
CREATE INDEX IF NOT EXISTS vouchers_by_start ON vouchers (starts_at);
