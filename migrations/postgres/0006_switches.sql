-- Emergency switches (DESIGN §6): one row, read by every node at least once a second.
CREATE TABLE IF NOT EXISTS switches (
    id           INTEGER PRIMARY KEY CHECK (id = 1),
    sales_paused BOOLEAN NOT NULL DEFAULT FALSE,
    read_only    BOOLEAN NOT NULL DEFAULT FALSE,
    updated_at   BIGINT  NOT NULL DEFAULT 0,
    -- Bumped by every change: a node applies a read only if it is not older than what it holds.
    version      BIGINT  NOT NULL DEFAULT 0
);
INSERT INTO switches (id) VALUES (1) ON CONFLICT DO NOTHING;

-- Pre-heat looks for vouchers about to start every second on every node.
CREATE INDEX IF NOT EXISTS vouchers_by_start ON vouchers (starts_at);
