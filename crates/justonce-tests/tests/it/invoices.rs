//! The invoice example as users run it: a real process on a fresh database, started four at
//! once and then again.

use super::on_every_database;
use justonce_tests::{TestBackend, unique};
use std::process::Output;
use std::time::Duration;
use tokio::process::Command;

on_every_database!(
    the_invoice_job_invoices_each_customer_once_however_it_is_started,
    the_conformance_kit_passes_the_invoice_job,
);

const CUSTOMERS: i64 = 5;

async fn invoice_job(url: &str) -> Output {
    invoice_month(url, "2026-10").await
}

async fn invoice_month(url: &str, month: &str) -> Output {
    let run = Command::new(env!("CARGO_BIN_EXE_invoices"))
        .args(["--database", url, "--month", month])
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the invoice job hung")
        .expect("start the invoice job")
}

/// The rows of each table the job writes: invoices, keys, outbox.
async fn rows<DB: TestBackend>(pool: &sqlx::Pool<DB>) -> [i64; 3] {
    let mut counts = [0; 3];
    for (count, table) in counts
        .iter_mut()
        .zip(["invoices", "justonce_keys", "justonce_outbox"])
    {
        *count = DB::count(pool, format!("SELECT count(*) FROM {table}")).await;
    }
    counts
}

async fn the_invoice_job_invoices_each_customer_once_however_it_is_started<DB: TestBackend>(
    _test: &str,
) {
    let url = DB::create_database(&format!("inv_{}", unique())).await;

    // Four jobs at once on a database none of them has migrated yet.
    let racers = futures_util::future::join_all((0..4).map(|_| invoice_job(&url))).await;
    let mut created = 0;
    for output in &racers {
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "a racing job failed: {}{stdout}",
            String::from_utf8_lossy(&output.stderr)
        );
        let count: i64 = stdout
            .strip_prefix("created ")
            .and_then(|rest| rest.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("unexpected output {stdout:?}"));
        created += count;
    }
    assert_eq!(created, CUSTOMERS, "invoices created across the four jobs");

    let pool = sqlx::Pool::<DB>::connect(&url).await.unwrap();
    let after_race = rows(&pool).await;
    assert_eq!(after_race, [CUSTOMERS; 3]);
    let customers = DB::count(
        &pool,
        "SELECT count(DISTINCT customer) FROM invoices".to_owned(),
    )
    .await;
    assert_eq!(customers, CUSTOMERS, "one invoice per customer");

    // Once more: nothing to do, and no row added.
    let again = invoice_job(&url).await;
    assert!(again.status.success());
    assert_eq!(
        String::from_utf8_lossy(&again.stdout),
        "created 0 invoices, skipped 5 already invoiced\n"
    );
    assert_eq!(rows(&pool).await, after_race);

    pool.close().await;
    DB::drop_database(&url).await;
}

/// `justonce check --run` with the job as users start it: each month twice, some at once,
/// and one invoice per customer and month.
async fn the_conformance_kit_passes_the_invoice_job<DB: TestBackend>(_test: &str) {
    let url = DB::create_database(&format!("invchk_{}", unique())).await;
    // The job has run before, for a month the check does not send: its table exists.
    assert!(invoice_month(&url, "2030-12").await.status.success());

    let job = format!(
        "{} --database '{url}' --month {{key}}",
        env!("CARGO_BIN_EXE_invoices")
    );
    let months = (1..=6)
        .map(|m| format!("2031-{m:02}"))
        .collect::<Vec<_>>()
        .join(",");
    let output = super::check::check(&[
        "--run",
        &job,
        "--keys",
        &months,
        "--effects",
        "SELECT month FROM invoices WHERE customer = 'cust_481'",
        "--database",
        &url,
        "--delay",
        "0s",
    ])
    .await;
    super::check::assert_passed(&output, 6);
    let pool = sqlx::Pool::<DB>::connect(&url).await.unwrap();
    let invoices = DB::count(&pool, "SELECT count(*) FROM invoices".to_owned()).await;
    assert_eq!(
        invoices,
        7 * CUSTOMERS,
        "the month before and six months, once each"
    );
    pool.close().await;
    DB::drop_database(&url).await;
}

/// Turning a new SQLite file to WAL does not wait on the busy timeout, so jobs started at
/// once on a new file race for it. Before the connect retried, most runs of this test saw
/// a job fail with "database is locked" within its first twenty rounds.
#[tokio::test]
async fn jobs_started_at_once_on_a_new_sqlite_file_all_succeed() {
    for round in 0..50 {
        let url = sqlx::Sqlite::create_database(&format!("invwal_{}_{round}", unique())).await;
        let racers = futures_util::future::join_all((0..6).map(|_| invoice_job(&url))).await;
        for output in racers {
            assert!(
                output.status.success(),
                "round {round}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        sqlx::Sqlite::drop_database(&url).await;
    }
}
