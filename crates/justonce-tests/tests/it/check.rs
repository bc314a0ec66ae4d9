//! `justonce check`, the conformance kit, as users run it: here against a handler that
//! ignores the key, which it must catch; in `payments` and `invoices` against the examples,
//! which must pass.

use super::on_every_database;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use justonce_http::server::IdempotencyLayer;
use justonce_tests::{TestBackend, TestDb};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

on_every_database!(
    a_handler_that_ignores_the_key_is_caught,
    a_try_answered_409_while_the_first_runs_is_sent_again,
);

/// The `justonce` binary: `cargo test --workspace` builds it beside this test binary.
pub(crate) fn justonce() -> PathBuf {
    let test_binary = std::env::current_exe().unwrap();
    let bin = test_binary
        .parent()
        .and_then(Path::parent)
        .unwrap()
        .join("justonce");
    assert!(
        bin.is_file(),
        "{} is missing: build it with `cargo build -p justonce-cli`",
        bin.display()
    );
    bin
}

/// Runs `justonce check` with `args`, and an empty configuration.
pub(crate) async fn check(args: &[&str]) -> Output {
    let run = tokio::process::Command::new(justonce())
        .arg("--config")
        // An empty configuration: a file named by --config must exist.
        .arg("/dev/null")
        .arg("check")
        .args(args)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the check hung")
        .expect("start justonce check");
    eprintln!(
        "justonce check {args:?}:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// `justonce check TARGET` of `events` events with no delay, its effects read by
/// `effects` in `database`, with `more` arguments.
pub(crate) async fn check_events(
    target: &str,
    effects: &str,
    database: &str,
    events: usize,
    more: &[&str],
) -> Output {
    let events = events.to_string();
    let mut args = vec![
        target,
        "--effects",
        effects,
        "--database",
        database,
        "--events",
        &events,
        "--delay",
        "0s",
    ];
    args.extend_from_slice(more);
    check(&args).await
}

/// Asserts a check that passed: exit 0, both tries of each of `events` events taken, and one
/// effect each.
pub(crate) fn assert_passed(output: &Output, events: usize) {
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    let tries = 2 * events;
    assert!(
        stdout.contains(&format!("tries taken: {tries} of {tries}")),
        "{stdout}"
    );
    let effects = format!("effects: {events} events with one, 0 with none, 0 with more than one");
    assert!(stdout.contains(&effects), "{stdout}");
}

/// Serves `app` on a loopback port until the test ends; its URL.
pub(crate) async fn serve(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{address}")
}

async fn a_handler_that_ignores_the_key_is_caught<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let table = format!("{}broken", db.prefix);
    DB::execute(
        db.inbox.pool(),
        format!("CREATE TABLE {table} (event VARCHAR(255) NOT NULL)"),
    )
    .await
    .unwrap();
    // Acts on every request, whatever its key says.
    let pool = db.inbox.pool().clone();
    let insert = table.clone();
    let app = axum::Router::new().route(
        "/orders",
        post(move |headers: HeaderMap| async move {
            let key = headers["idempotency-key"].to_str().unwrap().to_owned();
            DB::execute(&pool, format!("INSERT INTO {insert} VALUES ('{key}')"))
                .await
                .unwrap();
            "ok"
        }),
    );
    let url = format!("{}/orders", serve(app).await);

    let effects = format!("SELECT event FROM {table}");
    let output = check_events(&url, &effects, &db.url, 6, &[]).await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "the check must fail");
    assert!(stdout.contains("tries taken: 12 of 12"), "{stdout}");
    assert!(
        stdout.contains("effects: 0 events with one, 0 with none, 6 with more than one"),
        "{stdout}"
    );
    let rows = DB::count(db.inbox.pool(), format!("SELECT count(*) FROM {table}")).await;
    assert_eq!(rows, 12, "each try acted");
    let events: Vec<&str> = stdout
        .lines()
        .filter(|line| line.contains(": 2 effects, sent "))
        .collect();
    assert_eq!(events.len(), 6, "every offending event is named: {stdout}");
    assert!(String::from_utf8_lossy(&output.stderr).contains("the effects are not one per event"));

    // Counted instead of listed, beside the first run's rows: caught, though not by event.
    let count = format!("SELECT count(*) FROM {table}");
    let output = check(&[
        &url,
        "--count",
        &count,
        "--database",
        &db.url,
        "--events",
        "6",
        "--delay",
        "0s",
    ])
    .await;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert_eq!(output.status.code(), Some(1), "{stdout}");
    assert!(
        stdout.contains("effects: 12 new for 6 events (counted 12 before, 24 after)"),
        "{stdout}"
    );

    DB::execute(db.inbox.pool(), format!("DROP TABLE {table}"))
        .await
        .unwrap();
    db.cleanup().await;
}

/// A slow handler behind the Idempotency-Key layer on leases: the second of two tries sent
/// at once is answered `409` with `Retry-After` while the first runs, and the kit, as a
/// retrying sender, sends it again and is answered with the stored response.
async fn a_try_answered_409_while_the_first_runs_is_sent_again<DB: TestBackend>(test: &str) {
    let db = TestDb::<DB>::new(test).await;
    let (pool, effects) = (db.inbox.pool().clone(), format!("{}effects", db.prefix));
    let app = axum::Router::new()
        .route(
            "/orders",
            post(move |headers: HeaderMap| async move {
                tokio::time::sleep(Duration::from_millis(500)).await;
                let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                let insert = format!("INSERT INTO {effects} VALUES ('orders', '{key}')");
                DB::execute(&pool, insert).await.unwrap();
                StatusCode::CREATED
            }),
        )
        .route_layer(
            IdempotencyLayer::new(db.inbox.clone())
                .shared()
                .lease_for(Duration::from_secs(2)),
        );
    let url = format!("{}/orders", serve(app).await);

    let effects = format!("SELECT msg_key FROM {}effects", db.prefix);
    // Event 1 is sent twice at once.
    let output = check_events(&url, &effects, &db.url, 1, &[]).await;
    assert_passed(&output, 1);
    assert_eq!(db.rows("effects").await, 1);
    db.cleanup().await;
}
