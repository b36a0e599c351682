-- The node-wide group commit in one round trip (DESIGN §2, §3, §4).
--
-- One call commits the batches of many vouchers at once. Each batch draws on its own lease and
-- passes its own fence; every row gets its own verdict. The vouchers of one call are distinct
-- and so are the order ids of different batches (the caller splits repeats into another call,
-- its own transaction): per-customer limits never span two batches of a call, and an order id
-- is never decided by another batch's row that does not insert.
--
-- Locks, in this order, so that calls of different nodes never wait on each other in a cycle:
--   1. the batches' leases, in id order (the fence);
--   2. one transaction-level advisory lock per (voucher, customer) of the call, in key order
--      (migration 15: usage is counted from the reservation rows; the lock serialises two
--      calls that decide for the same customer, as the usage rows' own locks did). The key is
--      a 32-bit hash of the pair: two pairs that share one only wait for each other;
--   3. new reservation rows, in order-id order (a row another transaction stored meanwhile is
--      skipped and reported LOST; the caller reads the stored row after commit);
--   4. the change feed's head (`feed_head`, migration 7), last, held to commit: the call's new
--      reservations take the next numbers, in order-id order, as one `feed_batches` row. Only
--      this short step and the commit run one call at a time cluster-wide; the work above runs
--      side by side.
-- Voucher rows are only read: batches never queue on them.
--
-- Named `_v2`: an older build re-creates `vouchers_commit_batches` at its start, which must not
-- replace this one (it would leave new reservations out of the change feed).
--
-- Verdicts per row: NOT_FOUND (no such voucher), INSERT (a new reservation), REPLAYED (the
-- stored order of the same voucher and customer answers it), SAME (a repeat of an earlier row of the batch: it gets that row's
-- answer), ALREADY_USED, PAUSED / NOT_STARTED / ENDED (the ledger's copy of the voucher refuses
-- new reservations), LOST (see 3), FENCED (the batch's lease is no longer ACTIVE or too small:
-- nothing of the batch is written; only a batch that would take units is fenced).
-- A row without an order id (which the caller never sends) fails the whole call if its batch
-- would take units; an earlier version dropped the row and committed the rest.

CREATE OR REPLACE FUNCTION vouchers_commit_batches_v2(
    p_lease    BIGINT[],  -- per batch: the lease it draws on
    p_code     TEXT[],    -- per batch: its voucher
    p_now      BIGINT[],  -- per batch: the node's time when the batch formed
    p_expires  BIGINT[],  -- per batch: when its reservations expire unless confirmed
    p_batch    INT[],     -- per row: 1-based index of its batch
    p_order    TEXT[],    -- per row
    p_customer BIGINT[]   -- per row
) RETURNS TABLE (
    out_idx      INT,
    out_verdict  TEXT,
    out_discount BIGINT,
    out_voucher  TEXT,
    out_customer BIGINT,
    out_status   TEXT,
    out_expires  BIGINT
)
LANGUAGE plpgsql
-- Plans made once per connection, not at every call (planning the statement below cost as much
-- as running it). Generic plans never see the tables' sizes, so they are kept off sequential
-- scans: every lookup here has its index, and an index plan chosen while a table is tiny stays
-- right when it holds millions of rows.
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
AS $$
#variable_conflict use_column
DECLARE
    -- The answer, one array per output column, in row order.
    a_idx      INT[];
    a_verdict  TEXT[];
    a_discount BIGINT[];
    a_voucher  TEXT[];
    a_customer BIGINT[];
    a_status   TEXT[];
    a_expires  BIGINT[];
    v_inserted TEXT[];  -- the order ids this call inserted, in order-id order
    v_last     BIGINT;  -- the feed number of the last of them
    v_keys     INT[];   -- the customers' lock keys, in order
    v_leases   BIGINT[]; -- the leases new reservations drew on, in id order
    v_taken    BIGINT[]; -- how many each of them took
    -- The usage probes' statuses, as parameters of the generic plan rather than literals: a
    -- literal 'RESERVED' proves the partial index `reservations_due` (WHERE status =
    -- 'RESERVED') usable, and a plan made while the table was empty and analyzed so (a new
    -- database analyzed before its first sale, a truncated table) chose it, then read every
    -- reserved row per probe until autovacuum analyzed the table again: 2.2-2.5 ms per
    -- reservation on average over the first 36,000 (docs/PERFORMANCE.md). A parameter proves
    -- nothing, so the probes keep to `reservations_by_customer` (or, while it is still there
    -- after migration 15, `reservations_by_voucher`, as before). A node of an older build
    -- re-creates this function with the literals at its start: the plan hazard comes back
    -- until a node of this build starts again; the answers are the same, so the name stays
    -- (unlike grant.sql's versions, whose answers changed).
    c_reserved  CONSTANT TEXT := 'RESERVED';
    c_confirmed CONSTANT TEXT := 'CONFIRMED';
BEGIN
    -- The fence of the order claims across shards (migration 13): a commit not made by a node
    -- that claims its orders (`vouchers.claimed`, set by vouchers_commit_batches_claimed) is
    -- refused once this database's claims began. The lock first: the read after it takes a
    -- fresh snapshot, so it sees a copier's row committed while this call waited for the lock.
    -- The read needs a snapshot newer than the lock: READ COMMITTED (the default) takes one
    -- per statement; a session set to a stricter level is refused.
    -- Every path: the customers' locks (below) rely on it too.
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'the merged commit needs READ COMMITTED' USING ERRCODE = 'VC002';
    END IF;
    IF current_setting('vouchers.claimed', true) IS DISTINCT FROM 'on' THEN
        PERFORM pg_advisory_xact_lock_shared(8534436735584641637);
        IF EXISTS (SELECT 1 FROM claims_begun) THEN
            RAISE EXCEPTION 'order claims began here: list every shard in ledger.shards'
                USING ERRCODE = 'VC001';
        END IF;
    END IF;

    PERFORM 1 FROM leases WHERE id = ANY (p_lease) ORDER BY id FOR UPDATE;

    -- The customers' locks (see 2. above; class 1447253331 is this function's own), one per
    -- distinct key, in key order. They live in PostgreSQL's lock table, which every session
    -- of the server shares (about max_locks_per_transaction x the backends) and which, once
    -- full, fails every writing transaction of the server: the caller keeps a call under 512
    -- of them, and a call over 1024 (a caller that does not, such as an older build) is
    -- refused here before it takes any.
    v_keys := ARRAY(
        SELECT DISTINCT hashtext(p_code[t.b] || ' ' || t.c::text)
        FROM unnest(p_batch, p_customer) AS t (b, c)
        ORDER BY 1);
    IF cardinality(v_keys) > 1024 THEN
        RAISE EXCEPTION 'a merged commit of % customers: at most 1024 per call',
            cardinality(v_keys) USING ERRCODE = 'VC003';
    END IF;
    PERFORM pg_advisory_xact_lock(1447253331, k.k)
    FROM unnest(v_keys) WITH ORDINALITY AS k (k, i) ORDER BY k.i;

    -- A new statement: its snapshot sees everything committed before the locks were granted.
    -- Each row with the first row of the call that carries its order id (a repeat gets that
    -- row's answer), by a window rather than a join: a join of the rows with their first
    -- rows could be planned as a nested loop, quadratic in the call.
    WITH r AS (
        SELECT t.i::int AS idx, t.b, t.o, t.c, p_code[t.b] AS code,
               first_value(t.i::int) OVER w AS first_idx,
               first_value(p_code[t.b]) OVER w AS first_code,
               first_value(t.c) OVER w AS first_c
        FROM unnest(p_batch, p_order, p_customer) WITH ORDINALITY AS t (b, o, c, i)
        WINDOW w AS (PARTITION BY t.o ORDER BY t.i)
    ),
    h AS (
        SELECT b.i::int AS b, l.granted - l.consumed AS room,
               l.id IS NULL OR l.voucher_code <> b.code OR l.state <> 'ACTIVE' AS dead,
               v.per_user_limit, v.discount_amount,
               CASE WHEN v.status <> 'ACTIVE' THEN 'PAUSED'
                    WHEN p_now[b.i] < v.starts_at THEN 'NOT_STARTED'
                    WHEN p_now[b.i] >= v.ends_at THEN 'ENDED' END AS blocked
        FROM unnest(p_lease, p_code) WITH ORDINALITY AS b (lease_id, code, i)
        -- Each batch's voucher and lease are one primary-key lookup, as lateral subqueries that
        -- the planner cannot turn into a join. The plan is made once per connection, perhaps
        -- while the tables were small: joined, a plan made then hashed a whole scan of each
        -- table's primary key at every call, and the tables only grow (every lease ever
        -- granted, every voucher): 10x slower per call at 200,000 closed leases and 100,000
        -- vouchers. (Bounding the join by `= ANY` of the call's keys instead made each lookup
        -- walk the whole array: quadratic in the batches.) A node of an older build re-creates
        -- this function with the joins at its start: the hazard is back, with the same answers,
        -- until a node of this build starts again.
        JOIN LATERAL (
            SELECT v.per_user_limit, v.discount_amount, v.status, v.starts_at, v.ends_at
            FROM vouchers v WHERE v.code = b.code OFFSET 0) v ON true
        -- By id alone: with the state in the lookup, the generic plan read every ACTIVE lease
        -- of the cluster once per batch.
        LEFT JOIN LATERAL (
            SELECT l.id, l.voucher_code, l.state, l.granted, l.consumed
            FROM leases l WHERE l.id = b.lease_id OFFSET 0) l ON true
    ),
    s AS (
        SELECT x.order_id, x.voucher_code, x.customer_id, x.discount_amount, x.status, x.expires_at
        FROM reservations x WHERE x.order_id = ANY (p_order)
    ),
    p AS (
        SELECT r.idx, r.b, r.o, r.c, r.code, h.b IS NULL AS missing, h.dead, h.room,
               h.per_user_limit,
               COALESCE(s.discount_amount, h.discount_amount) AS discount,
               s.voucher_code AS s_voucher, s.customer_id AS s_customer, s.status AS s_status,
               s.expires_at AS s_expires,
               CASE
                 WHEN h.b IS NULL THEN 'NOT_FOUND'
                 WHEN s.order_id IS NOT NULL THEN
                   CASE WHEN s.voucher_code = r.code AND s.customer_id = r.c
                             AND s.status <> 'RELEASED'
                             AND NOT (s.status = 'RESERVED' AND s.expires_at <= p_now[r.b])
                        THEN 'REPLAYED' ELSE COALESCE(h.blocked, 'ALREADY_USED') END
                 WHEN r.first_idx <> r.idx THEN
                   CASE WHEN r.first_code = r.code AND r.first_c = r.c
                        THEN 'SAME' ELSE COALESCE(h.blocked, 'ALREADY_USED') END
                 WHEN h.blocked IS NOT NULL THEN h.blocked
                 ELSE 'CANDIDATE'
               END AS v0
        FROM r
        LEFT JOIN h ON h.b = r.b
        LEFT JOIN s ON s.order_id = r.o
    ),
    q AS (
        SELECT p.*,
               CASE WHEN p.v0 <> 'CANDIDATE' THEN p.v0
                    WHEN COALESCE(u.used, 0) + row_number() OVER (
                           PARTITION BY p.code, p.c, p.v0 ORDER BY p.idx) <= p.per_user_limit
                    THEN 'INSERT'
                    ELSE 'ALREADY_USED' END AS v1
        FROM p
        -- The customer's live rows, by `reservations_by_customer` (migration 15): committed
        -- before the lock was had, so every earlier decision for the pair is counted. One
        -- probe per live status, each on the whole index key (an IN list over the status was
        -- a filter, which read every released row of the customer: RELEASED sorts between the
        -- two), no more than the limit counted (all a verdict needs), and only for candidates.
        LEFT JOIN LATERAL (
            SELECT (SELECT count(*) FROM (
                        SELECT 1 FROM reservations x
                        WHERE p.v0 = 'CANDIDATE' AND x.voucher_code = p.code
                          AND x.customer_id = p.c AND x.status = c_reserved
                        LIMIT p.per_user_limit) a)
                 + (SELECT count(*) FROM (
                        SELECT 1 FROM reservations x
                        WHERE p.v0 = 'CANDIDATE' AND x.voucher_code = p.code
                          AND x.customer_id = p.c AND x.status = c_confirmed
                        LIMIT p.per_user_limit) b) AS used
        ) u ON true
    ),
    -- The fence, only for batches that would take units: a batch of replays and refusals
    -- answers even on a lease that is gone.
    k AS (
        SELECT q.b,
               count(*) FILTER (WHERE q.v1 = 'INSERT') > 0
                 AND (bool_or(q.dead)
                      OR count(*) FILTER (WHERE q.v1 = 'INSERT') > COALESCE(min(q.room), 0))
                 AS fenced
        FROM q GROUP BY q.b
    ),
    ins AS (
        INSERT INTO reservations (order_id, voucher_code, customer_id, lease_id, discount_amount,
                                  status, created_at, expires_at, updated_at, fed)
        SELECT q.o, q.code, q.c, p_lease[q.b], q.discount, 'RESERVED', p_now[q.b],
               p_expires[q.b], p_now[q.b], true
        FROM q JOIN k ON k.b = q.b
        WHERE q.v1 = 'INSERT' AND NOT k.fenced
        ORDER BY q.o
        ON CONFLICT (order_id) DO NOTHING
        RETURNING order_id, lease_id, voucher_code, customer_id
    ),
    d AS (
        SELECT ins.lease_id, count(*) AS n FROM ins GROUP BY ins.lease_id
    )
    SELECT array_agg(o.idx ORDER BY o.idx), array_agg(o.verdict ORDER BY o.idx),
           array_agg(o.discount ORDER BY o.idx), array_agg(o.s_voucher ORDER BY o.idx),
           array_agg(o.s_customer ORDER BY o.idx), array_agg(o.s_status ORDER BY o.idx),
           array_agg(o.s_expires ORDER BY o.idx),
           array_agg(o.o ORDER BY o.o) FILTER (WHERE o.inserted),
           (SELECT array_agg(d.lease_id ORDER BY d.lease_id) FROM d),
           (SELECT array_agg(d.n ORDER BY d.lease_id) FROM d)
    INTO a_idx, a_verdict, a_discount, a_voucher, a_customer, a_status, a_expires, v_inserted,
         v_leases, v_taken
    FROM (
        SELECT q.idx,
               CASE WHEN k.fenced THEN 'FENCED'
                    WHEN q.v1 = 'INSERT' AND ins.order_id IS NULL THEN 'LOST'
                    ELSE q.v1 END AS verdict,
               q.discount, q.s_voucher, q.s_customer, q.s_status, q.s_expires, q.o,
               ins.order_id IS NOT NULL AS inserted
        FROM q
        JOIN k ON k.b = q.b
        LEFT JOIN ins ON ins.order_id = q.o AND q.v1 = 'INSERT'
    ) o;

    -- The units the new reservations took, on their leases (locked above). A statement of its
    -- own, by `= ANY` of the leases alone: joined to the counts, a plan made while `leases`
    -- held a row or two read the whole primary key once per lease, and kept doing so as the
    -- table grew (every lease ever granted stays).
    IF cardinality(v_leases) > 0 THEN
        UPDATE leases l SET consumed = l.consumed + v_taken[array_position(v_leases, l.id)]
        WHERE l.id = ANY (v_leases);
    END IF;

    -- The change feed, last: the new reservations' numbers, held to commit.
    IF cardinality(v_inserted) > 0 THEN
        UPDATE feed_head SET last = last + cardinality(v_inserted) WHERE id = 1
        RETURNING last INTO v_last;
        IF v_last IS NULL THEN
            RAISE EXCEPTION 'the change feed''s head row is missing';
        END IF;
        INSERT INTO feed_batches (last_seq, orders) VALUES (v_last, v_inserted);
    END IF;

    RETURN QUERY
    SELECT * FROM unnest(a_idx, a_verdict, a_discount, a_voucher, a_customer, a_status, a_expires);
END
$$;
