//! `scripts/peers` with tiny counts: it installs the peers when they are missing (about 15 s
//! the first time, from PyPI and npm; `scripts/services` installs them beforehand), prints
//! a ratio per round and their medians, for `Inbox::run` and `Inbox::run_effect` (one bench
//! run; with two workers, also two bench processes) and the receiver, one `serve` process
//! and two, and one delivering as it stores, and each side stored every effect once (the
//! delivering one sent each too). With --relays, `justonce serve` relays
//! in one and two processes.

use justonce_sql::sqlx::{self, PgPool};
use std::path::Path;

const ROUNDS: usize = 2;
const MESSAGES: usize = 300;
const REQUESTS: i64 = 100;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_peers_run_beside_justonce_and_each_stores_every_effect_once() {
    let scratch = format!("justonce_peers_test_{}", justonce_tests::unique());
    let server = justonce_tests::postgres_url();
    let output = peers(&server, |command| {
        command
            .args(["--rounds", &ROUNDS.to_string()])
            .args(["--messages", &MESSAGES.to_string()])
            .args(["--requests", &REQUESTS.to_string(), "--clients", "4"])
            .args([
                "--rate",
                "200",
                "--probe",
                "20",
                "--scratch",
                &scratch,
                "--keep",
                "--processes",
                "2",
                "--delivering",
            ]);
    })
    .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);

    // What each side stored in the last round, read before the database goes.
    let (base, _) = server.rsplit_once('/').expect("a database in the URL");
    let stored = match PgPool::connect(&format!("{base}/{scratch}")).await {
        Ok(pool) => {
            let counts = stored(&pool).await;
            pool.close().await;
            Some(counts)
        }
        Err(_) => None,
    };
    let admin = PgPool::connect(&server).await.unwrap();
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
        "DROP DATABASE IF EXISTS {scratch}"
    )))
    .execute(&admin)
    .await
    .unwrap();

    assert!(output.status.success(), "{stdout}\n{stderr}");
    let probes = stdout
        .lines()
        .filter(|l| l.contains("fsync probe:"))
        .count();
    assert_eq!(probes, ROUNDS, "{stdout}");
    for comparison in [
        "consumer, 1 worker",
        "consumer, 2 workers",
        "consumer, 2 processes",
        "run_effect, 1 worker",
        "run_effect, 2 workers",
        "run_effect, 2 processes",
        "receiver, 4 clients",
        "receiver, 2 processes",
        "receiver delivering, 4 clients",
    ] {
        for round in 1..=ROUNDS {
            let line = stdout
                .lines()
                .find(|l| l.starts_with(&format!("round {round}  {comparison}")))
                .unwrap_or_else(|| panic!("no round {round} of {comparison}:\n{stdout}"));
            assert!(ratio_after(line, "ratio ") > 0.0, "{line}");
        }
        let summary = stdout
            .lines()
            .find(|l| l.starts_with(comparison) && l.contains("ratio median"))
            .unwrap_or_else(|| panic!("no median of {comparison}:\n{stdout}"));
        assert!(ratio_after(summary, "ratio median ") > 0.0, "{summary}");
        assert!(
            summary.ends_with(&format!("over {ROUNDS} round(s)")),
            "{summary}"
        );
    }

    let stored = stored.expect("the kept database");
    let distinct = distinct_keys(MESSAGES, 20);
    assert_eq!(stored.consumer_keys, distinct);
    assert_eq!(stored.consumer_effects, (distinct, distinct));
    assert_eq!(stored.receiver_keys, 2 * REQUESTS);
    assert_eq!(stored.receiver_outbox, (2 * REQUESTS, 2 * REQUESTS));
    // The round's last `serve` delivered as it stored.
    assert_eq!(stored.serve_outbox, (2 * REQUESTS, 2 * REQUESTS));
}

/// `scripts/peers --relays-only`: relays in one and in two processes deliver every stored
/// event (the script fails otherwise), each round in its order, and the end gives each
/// number's median deliveries/s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_relays_run_in_one_and_two_processes_and_deliver_every_event() {
    let scratch = format!("justonce_peers_test_{}", justonce_tests::unique());
    let output = peers(&justonce_tests::postgres_url(), |command| {
        command
            .args(["--rounds", &ROUNDS.to_string(), "--probe", "20"])
            .args(["--relays-only", "--relays", "1,2"])
            .args(["--deliveries", "200", "--targets", "2", "--clients", "4"])
            .args(["--scratch", &scratch]);
    })
    .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}\n{stderr}");
    assert!(
        stdout.starts_with("relays: 200 events, 2 targets;"),
        "{stdout}"
    );
    assert!(!stdout.contains("ratio"), "a peer was measured:\n{stdout}");
    let rounds: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains("  relay, ") && l.starts_with("round "))
        .collect();
    // Rising in odd rounds, falling in even ones.
    let order: Vec<&str> = rounds
        .iter()
        .map(|l| {
            l.split("relay, ")
                .nth(1)
                .unwrap()
                .split(' ')
                .next()
                .unwrap()
        })
        .collect();
    assert_eq!(order, ["1", "2", "2", "1"], "{stdout}");
    for line in rounds {
        assert!(number_before(line, " deliveries/s") > 0.0, "{line}");
    }
    for processes in ["1 process", "2 processes"] {
        let summary = stdout
            .lines()
            .find(|l| l.starts_with(&format!("relay, {processes}")) && l.contains("median"))
            .unwrap_or_else(|| panic!("no median of {processes} relays:\n{stdout}"));
        assert!(ratio_after(summary, "median ") > 0.0, "{summary}");
        assert!(
            summary.ends_with(&format!("over {ROUNDS} round(s)")),
            "{summary}"
        );
    }
}

/// The number just before `marker` in `line`.
fn number_before(line: &str, marker: &str) -> f64 {
    let (before, _) = line.split_once(marker).expect("the marker");
    let number = before.split_whitespace().last().expect("a number");
    number
        .parse()
        .unwrap_or_else(|_| panic!("{number} in {line}"))
}

/// Rows the peers and `justonce serve` left; (rows, distinct keys) where both count.
struct Stored {
    consumer_keys: i64,
    consumer_effects: (i64, i64),
    receiver_keys: i64,
    receiver_outbox: (i64, i64),
    /// Rows, and rows sent.
    serve_outbox: (i64, i64),
}

async fn stored(pool: &PgPool) -> Stored {
    let count = |sql: &'static str| async move {
        sqlx::query_as::<_, (i64, i64)>(sql)
            .fetch_one(pool)
            .await
            .unwrap()
    };
    Stored {
        consumer_keys: count("SELECT count(*), 0::bigint FROM peer_consumer_keys")
            .await
            .0,
        consumer_effects: count(
            "SELECT count(*), count(DISTINCT effect_key) FROM peer_consumer_effects",
        )
        .await,
        receiver_keys: count("SELECT count(*), 0::bigint FROM peer_receiver_keys")
            .await
            .0,
        receiver_outbox: count("SELECT count(*), count(DISTINCT key) FROM peer_receiver_outbox")
            .await,
        serve_outbox: count(
            "SELECT count(*), count(*) FILTER (WHERE sent_at IS NOT NULL) FROM justonce_outbox",
        )
        .await,
    }
}

/// The number after `marker` in `line`.
fn ratio_after(line: &str, marker: &str) -> f64 {
    let (_, rest) = line.split_once(marker).expect("the marker");
    let number = rest.split_whitespace().next().expect("a number");
    number
        .parse()
        .unwrap_or_else(|_| panic!("{number} in {line}"))
}

/// Distinct keys of the stream `justonce bench` and the Python consumer both generate.
fn distinct_keys(messages: usize, duplicates: usize) -> i64 {
    (0..messages)
        .filter(|n| *n == 0 || (n * 7_919) % 100 >= duplicates)
        .count() as i64
}

/// One run of the script at a time: it picks free ports before its servers bind them, so
/// two runs side by side may pick the same one.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Runs `scripts/peers` on the database `server` with this build's binary and the
/// arguments `args` adds. A hung install or peer fails the test; the script is killed
/// with the future.
async fn peers(
    server: &str,
    args: impl FnOnce(&mut tokio::process::Command),
) -> std::process::Output {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/peers");
    let mut command = tokio::process::Command::new(script);
    command
        .args([
            "--database",
            server,
            "--bin",
            env!("CARGO_BIN_EXE_justonce"),
        ])
        .kill_on_drop(true);
    args(&mut command);
    let _alone = ONE_AT_A_TIME.lock().await;
    tokio::time::timeout(std::time::Duration::from_secs(600), command.output())
        .await
        .expect("scripts/peers ends within 10 minutes")
        .expect("run scripts/peers")
}
