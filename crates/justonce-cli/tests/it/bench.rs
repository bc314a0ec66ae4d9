//! `justonce bench` against each real database, small: every section reports, every
//! throughput result saw effect rows equal distinct keys, the charts have a point per
//! result, and its tables are gone after.

use crate::folder::Folder;
use justonce_tests::{TestBackend, TestDb};
use std::process::Stdio;
use std::time::Duration;

macro_rules! on_every_database {
    ($($test:ident),* $(,)?) => {
        $(
            mod $test {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn sqlite() {
                    super::$test::<justonce_sql::sqlx::Sqlite>("bench_sqlite").await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn postgres() {
                    super::$test::<justonce_sql::sqlx::Postgres>("bench_postgres").await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn mysql() {
                    super::$test::<justonce_sql::sqlx::MySql>("bench_mysql").await
                }
            }
        )*
    };
}

on_every_database!(
    every_section_reports_and_leaves_no_table_behind,
    the_sustained_run_reports_a_peak_per_tenth,
    batched_only_measures_the_batched_modes_alone,
    an_interrupted_bench_drops_its_tables,
    the_capacity_section_sizes_and_purges_keys_and_outbox_rows,
);

async fn every_section_reports_and_leaves_no_table_behind<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let charts = std::env::temp_dir().join(format!("justonce-{test}-{}", justonce_tests::unique()));
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
        .args([
            "bench",
            "--database",
            &db.url,
            "--json",
            "--messages",
            "2000",
        ])
        .args([
            "--batch",
            "10,100",
            "--workers",
            "2",
            "--rounds",
            "2",
            "--sizes",
            "1000,5000",
        ])
        .args(["--samples", "50", "--purge", "5000"])
        .args(["--requests", "300", "--clients", "4", "--rate", "200"])
        .arg("--chart")
        .arg(&charts)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start justonce bench");
    let pid = child.id().expect("a running bench");
    let output = child.wait_with_output().await.unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let results = json_lines(&stdout);
    let of = |bench: &str| -> Vec<&serde_json::Value> {
        results.iter().filter(|r| r["bench"] == bench).collect()
    };

    let throughput = of("throughput");
    let modes: Vec<&str> = throughput
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    let mut expected = vec![
        "hand-written",
        "run",
        "run-again",
        "run_effect",
        "hand-written-forward",
        "run_forward",
        "run-with-forward",
        "hand-written-batched",
        "hand-written-claim_many",
        "claim_many",
        "hand-written-batched",
        "hand-written-claim_many",
        "claim_many",
    ];
    if db.url.starts_with("postgres") {
        expected.insert(1, "one-statement");
    }
    assert_eq!(modes, expected);
    let batches: Vec<&serde_json::Value> = throughput.iter().map(|r| &r["batch"]).collect();
    assert_eq!(batches[batches.len() - 6..], [10, 10, 10, 100, 100, 100]);
    let distinct = &throughput[0]["effects"];
    for result in &throughput {
        assert_eq!(&result["effects"], distinct, "{result}");
        assert_eq!(result["effects_equal_distinct_keys"], true);
        assert_eq!(result["rounds"], 2, "{result}");
        let per_round = result["messages_per_second_per_round"].as_array().unwrap();
        assert_eq!(per_round.len(), 2, "{result}");
        assert!(
            per_round.iter().all(|r| r.as_f64().unwrap() > 0.0),
            "{result}"
        );
        assert!(result["messages_per_second"].as_f64().unwrap() > 0.0);
        assert_against_baseline(result);
    }
    // A fifth of 2,000 messages repeat a key.
    assert!(
        (1_500..2_000).contains(&distinct.as_i64().unwrap()),
        "{distinct}"
    );

    let latency = of("latency");
    let sizes: Vec<u64> = latency
        .iter()
        .map(|r| r["keys"].as_u64().unwrap())
        .collect();
    assert_eq!(sizes, [1_000, 5_000]);
    for result in latency {
        assert_eq!(result["claims"], 50);
        assert!(result["p50_ms"].as_f64().unwrap() <= result["p99_ms"].as_f64().unwrap());
        assert!(result["batched_messages_per_second"].as_f64().unwrap() > 0.0);
    }

    let [purge] = of("purge")[..] else {
        panic!("one purge result: {stdout}");
    };
    assert_eq!(purge["purged"], 5_000);
    assert!(purge["claims_during"].as_u64().unwrap() >= 50);
    // A point per batch size for claim_many, for its statements by hand and for the plain
    // batch insert; a p50 and a p99 per table size.
    let files: Vec<&str> = of("chart")
        .iter()
        .map(|r| r["file"].as_str().unwrap())
        .collect();
    for (name, points) in [
        ("throughput-by-batch.svg", 6),
        ("latency-by-table-size.svg", 4),
    ] {
        let path = charts.join(name);
        assert!(files.contains(&path.to_str().unwrap()), "{files:?}");
        let svg = std::fs::read_to_string(&path).expect("the chart is written");
        assert!(
            svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""),
            "{svg}"
        );
        assert!(svg.trim_end().ends_with("</svg>"), "{svg}");
        assert_eq!(svg.matches("<circle ").count(), points, "{name}: {svg}");
    }
    std::fs::remove_dir_all(&charts).unwrap();

    let receiver = of("receiver");
    let loads: Vec<(u64, Option<u64>, Option<u64>)> = receiver
        .iter()
        .map(|r| {
            (
                r["requests"].as_u64().unwrap(),
                r["clients"].as_u64(),
                r["rate"].as_u64(),
            )
        })
        .collect();
    assert_eq!(loads, [(300, Some(4), None), (300, None, Some(200))]);
    for result in receiver {
        assert!(result["accepted_per_second"].as_f64().unwrap() > 0.0);
        assert!(result["p50_ms"].as_f64().unwrap() <= result["p99_ms"].as_f64().unwrap());
    }

    let [memory] = of("memory")[..] else {
        panic!("one memory result: {stdout}");
    };
    assert!(memory["peak_rss_mib"].as_f64().unwrap() > 0.0);

    let left = DB::count(db.inbox.pool(), tables_named(&db.url, pid)).await;
    assert_eq!(left, 0, "the bench's tables are dropped");
    db.cleanup().await;
}

/// A mode measured against another reports the median, lowest and highest of its ratios to
/// it; a baseline reports none.
fn assert_against_baseline(result: &serde_json::Value) {
    let expected = match result["mode"].as_str().unwrap() {
        "hand-written" | "hand-written-forward" | "hand-written-batched" => None,
        "run_forward" | "run-with-forward" => Some("hand-written-forward"),
        "hand-written-claim_many" => Some("hand-written-batched"),
        "claim_many" => Some("hand-written-claim_many"),
        _ => Some("hand-written"),
    };
    assert_eq!(result["baseline"].as_str(), expected, "{result}");
    let ratio = |field: &str| result[field].as_f64();
    let [median, low, high] = [
        "against_baseline",
        "against_baseline_min",
        "against_baseline_max",
    ]
    .map(ratio);
    if expected.is_none() {
        assert_eq!([median, low, high], [None; 3], "{result}");
        return;
    }
    let [median, low, high] = [median, low, high].map(|r| r.expect("a ratio"));
    assert!(0.0 < low && low <= median && median <= high, "{result}");
}

/// `--only sustained`, which the default sections leave out, runs for `--duration` and
/// reports the peak RSS of each tenth of it.
async fn the_sustained_run_reports_a_peak_per_tenth<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let results = bench_json(&db.url, &["--only", "sustained", "--duration", "2s"]).await;
    let benches: Vec<&str> = results
        .iter()
        .map(|r| r["bench"].as_str().unwrap())
        .collect();
    assert_eq!(benches, ["sustained", "memory"]);
    let sustained = &results[0];
    assert_eq!(sustained["effects_equal_distinct_keys"], true);
    let (messages, effects) = (&sustained["messages"], &sustained["effects"]);
    // A fifth of the messages repeat a key.
    assert!(
        effects.as_f64().unwrap() < messages.as_f64().unwrap() * 0.9,
        "{sustained}"
    );
    let peaks = sustained["peak_rss_mib_per_tenth"].as_array().unwrap();
    assert_eq!(peaks.len(), 10, "{sustained}");
    assert!(
        peaks.iter().all(|p| p.as_f64().unwrap() > 0.0),
        "{sustained}"
    );
    db.cleanup().await;
}

/// `--batched-only` leaves out the one-by-one modes: the three batched ones, each checked
/// against its baseline, on a stream whose later batches repeat keys the earlier ones hold.
async fn batched_only_measures_the_batched_modes_alone<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let results = bench_json(
        &db.url,
        &[
            "--only",
            "throughput",
            "--batched-only",
            "--messages",
            "3000",
            "--batch",
            "500",
            "--rounds",
            "2",
        ],
    )
    .await;
    let throughput: Vec<&serde_json::Value> = results
        .iter()
        .filter(|r| r["bench"] == "throughput")
        .collect();
    let modes: Vec<&str> = throughput
        .iter()
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    assert_eq!(
        modes,
        [
            "hand-written-batched",
            "hand-written-claim_many",
            "claim_many"
        ]
    );
    // Each mode checked its effect rows against the stream's distinct keys, the same count.
    let distinct = &throughput[0]["effects"];
    assert!(
        (2_000..3_000).contains(&distinct.as_i64().unwrap()),
        "{distinct}"
    );
    for result in throughput {
        assert_eq!(result["batch"], 500, "{result}");
        assert_eq!(&result["effects"], distinct, "{result}");
        assert_against_baseline(result);
    }
    db.cleanup().await;
}

/// `--only capacity`, small: keys claimed and purged, outbox rows written, delivered and
/// purged, each step with its rate, its write-ahead log where the database has one, and
/// the table's bytes after it.
async fn the_capacity_section_sizes_and_purges_keys_and_outbox_rows<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let results = bench_json(
        &db.url,
        &[
            "--only",
            "capacity",
            "--capacity-keys",
            "3000",
            "--capacity-outbox",
            "300",
            "--batch",
            "500",
            "--purge-batch",
            "700",
        ],
    )
    .await;
    let steps: Vec<&serde_json::Value> = results
        .iter()
        .filter(|r| r["bench"] == "capacity")
        .collect();
    let names: Vec<&str> = steps.iter().map(|r| r["step"].as_str().unwrap()).collect();
    assert_eq!(
        names,
        [
            "keys claimed",
            "keys purged",
            "outbox written",
            "outbox delivered",
            "outbox purged"
        ]
    );
    let logged = !db.url.starts_with("sqlite");
    for (step, (rows, batch)) in steps.iter().zip([
        (3_000, 500),
        (3_000, 700),
        (300, 500),
        (300, 100),
        (300, 700),
    ]) {
        assert_eq!(step["rows"], rows, "{step}");
        assert_eq!(step["batch"], batch, "{step}");
        assert!(step["rows_per_second"].as_f64().unwrap() > 0.0, "{step}");
        let log = step["log_bytes_per_row"].as_f64();
        assert_eq!(log.is_some_and(|bytes| bytes > 0.0), logged, "{step}");
        let bytes = |field: &str| step[field].as_u64().unwrap();
        assert!(
            bytes("total_bytes") >= bytes("table_bytes") + bytes("index_bytes"),
            "{step}"
        );
    }
    let bytes = |step: usize, field: &str| steps[step][field].as_u64().unwrap();
    // Each key row holds its 43-byte key and 32-byte fingerprint, beside the purge index.
    assert!(bytes(0, "table_bytes") >= 3_000 * 75, "{}", steps[0]);
    assert!(bytes(0, "index_bytes") > 0, "{}", steps[0]);
    assert!(
        steps[0]["indexes"].get("keys_purge").is_some(),
        "{}",
        steps[0]
    );
    // Each outbox row holds its 1 KiB body.
    assert!(bytes(2, "table_bytes") >= 300 * 1_024, "{}", steps[2]);
    db.cleanup().await;
}

/// Ctrl-C in the middle of filling the key table: the bench stops, says so, and drops its
/// tables on the way out.
async fn an_interrupted_bench_drops_its_tables<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let child = tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
        .args(["bench", "--database", &db.url, "--only", "latency"])
        .args(["--sizes", "100000000"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("start justonce bench");
    let pid = child.id().expect("a running bench");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while DB::count(db.inbox.pool(), tables_named(&db.url, pid)).await == 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the bench made no tables"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Into the filling, which alone would take many minutes.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let signalled = tokio::process::Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status()
        .await
        .unwrap();
    assert!(signalled.success());
    let output = tokio::time::timeout(Duration::from_secs(60), child.wait_with_output())
        .await
        .expect("the bench stops within a minute of Ctrl-C")
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(stderr.contains("interrupted"), "{stderr}");
    let left = DB::count(db.inbox.pool(), tables_named(&db.url, pid)).await;
    assert_eq!(left, 0, "the bench's tables are dropped");
    db.cleanup().await;
}

/// A query counting the tables of the bench process `pid`.
fn tables_named(url: &str, pid: u32) -> String {
    let like = format!("'justonce_bench_{pid}_%'");
    if url.starts_with("sqlite") {
        format!("SELECT COUNT(*) FROM sqlite_master WHERE type = 'table' AND name LIKE {like}")
    } else if url.starts_with("mysql") {
        format!(
            "SELECT COUNT(*) FROM information_schema.tables \
             WHERE table_schema = DATABASE() AND table_name LIKE {like}"
        )
    } else {
        format!("SELECT COUNT(*) FROM information_schema.tables WHERE table_name LIKE {like}")
    }
}

#[tokio::test]
async fn numbers_out_of_range_are_bad_usage() {
    let bench = ["bench", "--database", "sqlite::memory:"].as_slice();
    for (command, flag, value) in [
        (bench, "--duplicates", "100"),
        (bench, "--purge-pause", "-1"),
        (bench, "--purge-pause", "NaN"),
        (bench, "--workers", "0"),
        (bench, "--rounds", "0"),
        (bench, "--requests", "0"),
        (bench, "--clients", "0"),
        (bench, "--rate", "0"),
        (bench, "--batch", "100,0"),
        (bench, "--share", "0/2"),
        (bench, "--share", "3/2"),
        (bench, "--share", "half"),
        (bench, "--duration", "0s"),
        (bench, "--duration", "10"),
        (&["purge"], "--pause", "-1"),
        (&["purge"], "--pause", "101"),
    ] {
        let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
            .args(command)
            .arg(format!("{flag}={value}"))
            .output()
            .await
            .unwrap();
        assert_eq!(output.status.code(), Some(2), "{flag} {value}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(flag), "{stderr}");
    }
}

/// A `--database` of no kind the bench knows is bad usage: exit code 2, one line naming the
/// kinds it accepts, and nothing made.
#[tokio::test]
async fn an_unknown_database_is_bad_usage() {
    let folder = Folder::new("bench-unknown-database");
    for url in ["redis://127.0.0.1:6379", "justonce.db"] {
        let ran = folder.run(&[], &["bench", "--database", url]).await;
        assert_eq!(ran.code, 2, "{url}: {}", ran.stderr);
        assert_eq!(
            ran.stderr, "justonce: --database: must be a sqlite://, postgres:// or mysql:// URL\n",
            "{url}"
        );
        assert!(ran.stdout.is_empty(), "{url}: {}", ran.stdout);
    }
    assert_eq!(folder.entries(), Vec::<String>::new());
}

/// The results of `justonce bench --json` on `url` with `args`, once it has succeeded.
async fn bench_json(url: &str, args: &[&str]) -> Vec<serde_json::Value> {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
        .args(["bench", "--database", url, "--json"])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    json_lines(&stdout)
}

/// The bench's `--json` output: one object per line.
fn json_lines(stdout: &str) -> Vec<serde_json::Value> {
    stdout
        .lines()
        .map(|line| serde_json::from_str(line).expect("one JSON object per line"))
        .collect()
}

/// `--modes` measures the modes named, `run` with `run-again`; without their baselines they
/// print no ratio. A name that is no mode is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn modes_measures_only_the_modes_named() {
    let db = TestDb::<justonce_sql::sqlx::Sqlite>::new("bench_modes").await;
    let args = [
        "--only",
        "throughput",
        "--messages",
        "500",
        "--batch",
        "100",
    ];
    let results = bench_json(
        &db.url,
        &[&args[..], &["--rounds", "1", "--modes", "run,claim_many"]].concat(),
    )
    .await;
    let modes: Vec<&str> = results
        .iter()
        .filter(|r| r["bench"] == "throughput")
        .map(|r| r["mode"].as_str().unwrap())
        .collect();
    assert_eq!(modes, ["run", "run-again", "claim_many"]);
    for result in results.iter().filter(|r| r["bench"] == "throughput") {
        assert!(result["baseline"].is_null(), "{result}");
        assert!(result["against_baseline"].is_null(), "{result}");
    }

    let refused = tokio::process::Command::new(env!("CARGO_BIN_EXE_justonce"))
        .args(["bench", "--database", &db.url, "--modes", "fastest"])
        .output()
        .await
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("invalid value 'fastest' for '--modes"),
        "{stderr}"
    );
    db.cleanup().await;
}

/// `--share` runs one worker's share of the stream: each of two processes, one share each,
/// stores one effect per distinct key of its share, and says which share it ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn share_runs_one_workers_share_of_the_stream() {
    let db = TestDb::<justonce_sql::sqlx::Sqlite>::new("bench_share").await;
    let args = [
        "--only",
        "throughput",
        "--modes",
        "run_effect",
        "--messages",
        "501",
        "--rounds",
        "1",
    ];
    for share in ["1/2", "2/2"] {
        let results = bench_json(&db.url, &[&args[..], &["--share", share]].concat()).await;
        let throughput: Vec<_> = results
            .iter()
            .filter(|r| r["bench"] == "throughput")
            .collect();
        let [result] = &throughput[..] else {
            panic!("one throughput result: {results:?}");
        };
        assert_eq!(result["share"], share);
        assert_eq!(
            result["effects"],
            justonce_bench::distinct_in_share(501, 20, share).unwrap(),
            "{result}"
        );
    }
    db.cleanup().await;
}
