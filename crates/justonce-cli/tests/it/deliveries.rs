//! `justonce deliveries` and `justonce dlq` as an operator runs them: what is waiting and
//! why, each delivery's attempts, dead letters as JSON and by filter, and a purge that asks
//! first.

use crate::serve::{Server, claim_with_delivery, drop_database, run_capturing, server_and_worker};
use justonce_http::HttpDestination;
use justonce_sql::{Inbox, RelayOptions};
use justonce_tests::{Answer, Sink, TestBackend};
use serde_json::Value;
use std::sync::Arc;
use std::time::Duration;

on_every_database!(
    deliveries_list_due_shows_what_waits_oldest_first_and_why,
    deliveries_show_prints_each_attempt_in_order,
    dlq_list_json_parses_and_filters,
    dlq_purge_without_yes_purges_nothing_and_exits_2,
);

/// A sink answering each key's attempts in turn with `statuses` and `body`, then 200.
async fn answering(statuses: &'static [u16], body: &'static str) -> Sink {
    Sink::scripted(Arc::new(move |_, attempt| Answer {
        body: body.into(),
        ..Answer::status(statuses.get(attempt - 1).copied().unwrap_or(200))
    }))
    .await
}

/// The JSON a command printed, which must succeed.
async fn json_of(server: &Server, args: &[&str]) -> Vec<Value> {
    let (code, printed, stderr) = run_capturing(server, args).await;
    assert_eq!(code, 0, "{args:?}: {stderr}");
    serde_json::from_str(&printed)
        .unwrap_or_else(|e| panic!("{args:?} printed no JSON array ({e}): {printed}"))
}

fn ids(rows: &[Value]) -> Vec<i64> {
    rows.iter().map(|row| row["id"].as_i64().unwrap()).collect()
}

/// The ids of the deliveries waiting, oldest first.
async fn due_ids(server: &Server) -> Vec<i64> {
    ids(&json_of(server, &["deliveries", "list", "--due", "--json"]).await)
}

async fn deliveries_list_due_shows_what_waits_oldest_first_and_why<DB: TestBackend>(test: &str) {
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    claim_with_delivery(&worker, "order:1", "partner").await;
    claim_with_delivery(&worker, "order:2", "partner").await;
    claim_with_delivery(&worker, "order:3", "audit").await;
    let written = due_ids(&server).await;
    assert_eq!(written.len(), 3);
    // The oldest row fails once and waits an hour for its retry.
    let sink = answering(&[503], "down for maintenance").await;
    let options = RelayOptions::default()
        .batch_size(1)
        .first_backoff(Duration::from_secs(3_600));
    let relay = worker
        .outbox()
        .relay()
        .options(options)
        .destination("partner", HttpDestination::new(&sink.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().retried, 1);

    let (code, table, stderr) = run_capturing(&server, &["deliveries", "list", "--due"]).await;
    assert_eq!(code, 0, "{stderr}");
    let lines: Vec<&str> = table.lines().collect();
    assert_eq!(lines[0], "deliveries waiting", "{table}");
    let header: Vec<&str> = lines[1].split("  ").filter(|c| !c.is_empty()).collect();
    let header: Vec<&str> = header.iter().map(|c| c.trim()).collect();
    assert_eq!(
        header,
        [
            "id",
            "destination",
            "key",
            "attempts",
            "waiting",
            "next attempt",
            "last error"
        ]
    );
    let first: Vec<&str> = lines[2].split_whitespace().collect();
    assert_eq!(first[0], written[0].to_string(), "{table}");
    assert_eq!((first[1], first[3]), ("partner", "1"), "{table}");
    assert!(lines[2].contains("in 3"), "an hour to wait: {table}");
    assert!(
        lines[2].ends_with("answered 503 Service Unavailable: down for maintenance"),
        "{table}"
    );
    let second: Vec<&str> = lines[3].split_whitespace().collect();
    assert_eq!(second[0], written[1].to_string(), "{table}");
    assert_eq!((second[3], second[6]), ("0", "now"), "{table}");
    assert_eq!(lines[4].split_whitespace().nth(1), Some("audit"), "{table}");

    let due = json_of(&server, &["deliveries", "list", "--due", "--json"]).await;
    assert_eq!(ids(&due), written);
    assert_eq!(due[0]["destination"], "partner");
    assert_eq!(due[0]["attempts"], 1);
    assert!(due[0]["next_attempt_in_seconds"].as_f64().unwrap() > 3_000.0);
    assert!(due[0]["last_error"].as_str().unwrap().contains("503"));
    assert_eq!(due[1]["attempts"], 0);
    assert_eq!(due[1]["last_error"], Value::Null);
    assert_eq!(due[1]["scope"], Value::Null);
    let audit = json_of(
        &server,
        &[
            "deliveries",
            "list",
            "--due",
            "--destination",
            "audit",
            "--json",
        ],
    )
    .await;
    assert_eq!(ids(&audit), [written[2]]);

    // What to list is said, not guessed.
    let (code, _, stderr) = run_capturing(&server, &["deliveries", "list"]).await;
    assert_eq!(code, 2, "{stderr}");
    assert!(stderr.contains("--due"), "{stderr}");
    worker.pool().close().await;
    drop_database(db, &url).await;
}

async fn deliveries_show_prints_each_attempt_in_order<DB: TestBackend>(test: &str) {
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    claim_with_delivery(&worker, "order:1042", "partner").await;
    let due = json_of(&server, &["deliveries", "list", "--due", "--json"]).await;
    let (id, key) = (
        due[0]["id"].as_i64().unwrap(),
        due[0]["key"].as_str().unwrap(),
    );
    let sink = answering(&[503, 500], "{\"ok\":false}").await;
    let options = RelayOptions::default()
        .first_backoff(Duration::ZERO)
        .max_backoff(Duration::ZERO);
    let relay = worker
        .outbox()
        .relay()
        .options(options)
        .destination("partner", HttpDestination::new(&sink.url()).unwrap());
    for _ in 0..3 {
        relay.relay_once().await.unwrap();
    }
    assert_eq!(sink.requests(), 3);

    let id_text = id.to_string();
    for args in [
        vec!["deliveries", "show", id_text.as_str()],
        vec!["deliveries", "show", "--key", key],
    ] {
        let (code, shown, stderr) = run_capturing(&server, &args).await;
        assert_eq!(code, 0, "{args:?}: {stderr}");
        assert!(shown.contains(&format!("id:          {id}\n")), "{shown}");
        assert!(
            shown.contains("state:       sent after 3 attempts\n"),
            "{shown}"
        );
        let attempts: Vec<Vec<&str>> = shown
            .lines()
            .skip_while(|line| *line != "attempts")
            .skip(2)
            .take_while(|line| !line.is_empty())
            .map(|line| line.split_whitespace().collect())
            .collect();
        let numbers_and_statuses: Vec<(&str, &str)> =
            attempts.iter().map(|cells| (cells[0], cells[4])).collect();
        assert_eq!(
            numbers_and_statuses,
            [("1", "503"), ("2", "500"), ("3", "200")],
            "{shown}"
        );
        assert!(
            attempts[0][5..].join(" ").contains("answered 503"),
            "{shown}"
        );
        assert_eq!(attempts[2][5..].join(" "), "{\"ok\":false}", "{shown}");
    }
    let (code, _, stderr) = run_capturing(&server, &["deliveries", "show", "999999"]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("no delivery has id 999999"), "{stderr}");
    worker.pool().close().await;
    drop_database(db, &url).await;
}

/// Two dead letters, one for `partner` and one for `audit`, with their ids.
async fn two_dead_letters<DB: TestBackend>(worker: &Inbox<DB>, server: &Server) -> Vec<i64> {
    claim_with_delivery(worker, "order:1", "partner").await;
    claim_with_delivery(worker, "order:2", "audit").await;
    let written = due_ids(server).await;
    let refusing = answering(&[400, 400], "no such order").await;
    let relay = worker
        .outbox()
        .relay()
        .destination("partner", HttpDestination::new(&refusing.url()).unwrap())
        .destination("audit", HttpDestination::new(&refusing.url()).unwrap());
    assert_eq!(relay.relay_once().await.unwrap().dead, 2);
    written
}

async fn dlq_list_json_parses_and_filters<DB: TestBackend>(test: &str) {
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    let written = two_dead_letters(&worker, &server).await;

    let dead = json_of(&server, &["dlq", "list", "--json"]).await;
    assert_eq!(ids(&dead), written);
    assert_eq!(dead[0]["destination"], "partner");
    assert_eq!(dead[1]["destination"], "audit");
    assert_eq!(dead[0]["attempts"], 1);
    let error = dead[0]["last_error"].as_str().unwrap();
    assert!(
        error.contains("400") && error.contains("no such order"),
        "{error}"
    );
    assert!(dead[0]["key"].as_str().is_some_and(|key| !key.is_empty()));
    assert!(dead[0].get("next_attempt_in_seconds").is_none(), "{dead:?}");

    let filtered = |args: &'static [&'static str]| {
        let mut all = vec!["dlq", "list", "--json"];
        all.extend_from_slice(args);
        all
    };
    let audit = json_of(&server, &filtered(&["--destination", "audit"])).await;
    assert_eq!(ids(&audit), [written[1]]);
    let recent = json_of(&server, &filtered(&["--since", "2h"])).await;
    assert_eq!(ids(&recent), written);
    let older = json_of(&server, &filtered(&["--until", "1h"])).await;
    assert!(older.is_empty(), "{older:?}");
    let window = json_of(
        &server,
        &filtered(&["--since", "1d", "--until", "0s", "--destination", "partner"]),
    )
    .await;
    assert_eq!(ids(&window), [written[0]]);
    let one = json_of(&server, &filtered(&["--limit", "1"])).await;
    assert_eq!(ids(&one), [written[0]]);

    let (code, _, stderr) = run_capturing(&server, &["dlq", "list", "--since", "2 hours"]).await;
    assert_eq!(code, 2, "{stderr}");
    worker.pool().close().await;
    drop_database(db, &url).await;
}

async fn dlq_purge_without_yes_purges_nothing_and_exits_2<DB: TestBackend>(test: &str) {
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    let written = two_dead_letters(&worker, &server).await;

    let (code, printed, stderr) = run_capturing(&server, &["dlq", "purge"]).await;
    assert_eq!(code, 2, "{printed}{stderr}");
    assert!(stderr.contains("pass --yes"), "{stderr}");
    assert!(stderr.contains("nothing changed"), "{stderr}");
    assert_eq!(
        ids(&json_of(&server, &["dlq", "list", "--json"]).await),
        written
    );

    let (code, printed, stderr) = run_capturing(&server, &["dlq", "purge", "--yes"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(printed, "2 dead letters deleted\n");
    assert!(
        json_of(&server, &["dlq", "list", "--json"])
            .await
            .is_empty()
    );
    assert!(
        worker
            .outbox()
            .attempts(written[0])
            .await
            .unwrap()
            .is_empty(),
        "the history went with its row"
    );
    worker.pool().close().await;
    drop_database(db, &url).await;
}
