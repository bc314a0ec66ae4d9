//! The scheduled report example, compiled from its own source, on the real PostgreSQL: two
//! replicas ticking through one day write one report, and a tick on a day already reported
//! changes no row and sends nothing.

use justonce::Outcome;
use justonce_tests::{TestBackend, unique};
use sqlx::Postgres;
use std::time::Duration;

// The example's `main` is not called here.
#[allow(dead_code)]
#[path = "../../../justonce/examples/daily_report.rs"]
mod example;

/// Reports, keys and outbox rows (the emails to send).
async fn rows(pool: &sqlx::PgPool) -> [i64; 3] {
    let mut counts = [0; 3];
    for (count, table) in
        counts
            .iter_mut()
            .zip(["daily_reports", "justonce_keys", "justonce_outbox"])
    {
        *count = Postgres::count(pool, format!("SELECT count(*) FROM {table}")).await;
    }
    counts
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_day_ticked_twice_gets_one_report_and_one_email() {
    let url = Postgres::create_database(&format!("report_{}", unique())).await;
    let inbox = example::open(&url).await.unwrap();

    let first = example::report(&inbox, "2026-12-02").await.unwrap();
    assert!(matches!(first, Outcome::Processed(())));
    assert_eq!(rows(inbox.pool()).await, [1, 1, 1]);
    let second = example::report(&inbox, "2026-12-02").await.unwrap();
    assert!(matches!(second, Outcome::Duplicate));
    assert_eq!(
        rows(inbox.pool()).await,
        [1, 1, 1],
        "the second tick changes no row"
    );

    inbox.pool().close().await;
    Postgres::drop_database(&url).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_ticking_on_a_timer_write_each_day_once() {
    let url = Postgres::create_database(&format!("replicas_{}", unique())).await;
    // Two replicas: two processes' worth of connections, each with its own timer.
    let (a, b) = (
        example::open(&url).await.unwrap(),
        example::open(&url).await.unwrap(),
    );
    let ticking = |inbox| async move {
        let stop = tokio::time::sleep(Duration::from_millis(500));
        example::schedule(&inbox, Duration::from_millis(50), stop)
            .await
            .unwrap()
    };
    let (ticks_a, ticks_b) = tokio::join!(ticking(a.clone()), ticking(b));
    let written = ticks_a.written + ticks_b.written;
    assert!(
        ticks_a.skipped + ticks_b.skipped >= 10,
        "{ticks_a:?} {ticks_b:?}"
    );

    // One report per day: the run may have crossed midnight (UTC), never more than once.
    let days = Postgres::count(
        a.pool(),
        "SELECT count(DISTINCT day) FROM daily_reports".into(),
    )
    .await;
    assert_eq!(i64::from(written), days);
    assert!((1..=2).contains(&days));
    assert_eq!(rows(a.pool()).await, [days; 3]);

    a.pool().close().await;
    Postgres::drop_database(&url).await;
}
