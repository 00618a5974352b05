-- The raw event tables ordered for time-range queries: every reader (path building, lift,
-- rollup refreshes, the trainers' pages, the dashboard's bounds) asks for a range of `ts`, and
-- with `ORDER BY event_id` each such query read the whole of every month it touched. Now the
-- sorting key is (ts, event_id), so a range reads, inside its months' parts, only the granules
-- of its times. The partitions stay months: the sink cuts a batch into INSERT blocks of at most
-- `sink.max_partitions` months, under a current server's 100 partitions per INSERT block
-- (`max_partitions_per_insert_block`), and daily partitions would bring that limit down to 100
-- days of history per block (a replay of old events, a bulk load) and many small parts.
-- ReplacingMergeTree still collapses a re-delivered event: its copies carry the same event_id
-- and the same ts, so the same key (and partition).
-- ClickHouse 18.16 cannot change a MergeTree's key in place: `REBUILD TABLE` is attribution.migrate's
-- own statement (attribution.migrate.rebuild_table): a new table of the same columns with this
-- engine clause, the rows copied a month at a time, swapped in by RENAME, rows written meanwhile
-- copied over, the old table dropped once every event of it is in the new one. Safe to
-- interrupt and to run again; a table that already has this layout is left alone.
-- Accepted by ClickHouse 18.16 and by current releases.

REBUILD TABLE impressions ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id);
REBUILD TABLE clicks ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id);
REBUILD TABLE dwell ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id);
REBUILD TABLE conversions ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id);
REBUILD TABLE touches ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id);
REBUILD TABLE ads ENGINE = ReplacingMergeTree() PARTITION BY toYYYYMM(ts) ORDER BY (ts, event_id);
