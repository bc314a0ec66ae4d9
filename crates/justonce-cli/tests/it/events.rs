//! `justonce events` and `justonce replay` as an operator runs them against a real service:
//! events found by source, key and state a page at a time, shown whole, replayed one at a
//! time or by time range to the real target with the same Idempotency-Key, and kept for
//! their own retention past their keys'.

use crate::serve::{
    Server, client, database, drop_database, post, run_capturing, server_and_worker,
};
use justonce_http::HttpDestination;
use justonce_sql::{Consumer, Inbox, Key, Message};
use justonce_tests::{Sink, TestBackend};
use serde_json::Value;
use std::collections::HashMap;
use std::time::Duration;

on_every_database!(
    events_list_and_show_find_events_by_source_key_and_state_a_page_at_a_time,
    replay_says_what_it_would_do_and_with_yes_delivers_the_event_again,
    a_time_range_replay_of_100_events_delivers_each_once_more_with_the_same_key,
    an_event_outlives_its_key_until_its_event_retention_ends,
);

/// Stores one event of the source `demo`, as the receiver does; its key.
async fn receive<DB: TestBackend>(worker: &Inbox<DB>, id: &str) -> String {
    let key = Key::new(format!("demo:{id}")).unwrap();
    let body = format!(r#"{{"id":"{id}"}}"#);
    let message = Message::new("demo", body.clone().into_bytes());
    let outcome = worker
        .with_consumer(Consumer::new("demo").unwrap())
        .run_forward(&key, body.as_bytes(), message)
        .await
        .unwrap();
    assert!(
        matches!(outcome, justonce_sql::Outcome::Processed(())),
        "{key}"
    );
    key.as_str().to_owned()
}

/// Delivers everything due of `demo` to `sink`.
async fn deliver<DB: TestBackend>(worker: &Inbox<DB>, sink: &Sink) {
    let relay = worker
        .outbox()
        .relay()
        .destination("demo", HttpDestination::new(&sink.url()).unwrap());
    while relay.relay_once().await.unwrap().taken > 0 {}
}

/// The JSON a command printed, which must succeed.
async fn json_of(server: &Server, args: &[&str]) -> Value {
    let (code, printed, stderr) = run_capturing(server, args).await;
    assert_eq!(code, 0, "{args:?}: {stderr}");
    serde_json::from_str(&printed)
        .unwrap_or_else(|e| panic!("{args:?} printed no JSON ({e}): {printed}"))
}

fn keys_of(page: &Value) -> Vec<String> {
    page["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|event| event["key"].as_str().unwrap().to_owned())
        .collect()
}

/// How many requests `sink` received for each Idempotency-Key.
fn per_key(sink: &Sink) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for request in sink.received() {
        *counts.entry(request.key.unwrap_or_default()).or_default() += 1;
    }
    counts
}

async fn events_list_and_show_find_events_by_source_key_and_state_a_page_at_a_time<
    DB: TestBackend,
>(
    test: &str,
) {
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    for n in 0..5 {
        receive(&worker, &format!("order-{n}")).await;
    }
    receive(&worker, "refund-1").await;
    let sink = Sink::start().await;
    deliver(&worker, &sink).await;
    let waiting = receive(&worker, "order-5").await;

    let all = json_of(&server, &["events", "list", "--source", "demo", "--json"]).await;
    assert_eq!(keys_of(&all).len(), 7);
    assert_eq!(all["next_cursor"], Value::Null);
    assert_eq!(all["events"][0]["origin"], "demo");
    assert_eq!(all["events"][0]["state"], "delivered");
    assert_eq!(all["events"][0]["attempts"], 1);
    let due = json_of(&server, &["events", "list", "--state", "due", "--json"]).await;
    assert_eq!(keys_of(&due), [waiting.as_str()]);
    let refunds = ["events", "list", "--key-prefix", "demo:refund", "--json"];
    assert_eq!(
        keys_of(&json_of(&server, &refunds).await),
        ["demo:refund-1"]
    );
    let in_a_window = [
        "events",
        "list",
        "--since",
        "1h",
        "--until",
        "2999-01-01T00:00:00Z",
        "--json",
    ];
    assert_eq!(keys_of(&json_of(&server, &in_a_window).await).len(), 7);
    let before = [
        "events",
        "list",
        "--until",
        "2000-01-01T00:00:00+01:00",
        "--json",
    ];
    assert!(keys_of(&json_of(&server, &before).await).is_empty());

    // Pages of three, each after the cursor of the one before.
    let mut paged = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut args = vec!["events", "list", "--limit", "3", "--json"];
        if let Some(cursor) = &cursor {
            args.extend(["--cursor", cursor.as_str()]);
        }
        let page = json_of(&server, &args).await;
        paged.extend(keys_of(&page));
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(paged, keys_of(&all));
    let (code, table, stderr) = run_capturing(&server, &["events", "list", "--limit", "3"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(table.starts_with("events\n"), "{table}");
    assert!(table.contains("more: --cursor "), "{table}");
    // `--key` reads the last day unless given `--since`, and says so.
    let (code, table, stderr) = run_capturing(&server, &["events", "list", "--key", "fund"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(table.contains("demo:refund-1"), "{table}");
    assert!(
        table.contains("--key searched the events received from "),
        "{table}"
    );
    let since = ["events", "list", "--key", "fund", "--since", "1h", "--json"];
    let found = json_of(&server, &since).await;
    assert_eq!(keys_of(&found), ["demo:refund-1"]);
    assert_eq!(found["searched_since"], Value::Null);

    let id = all["events"][0]["id"].as_i64().unwrap().to_string();
    let shown = json_of(&server, &["events", "show", &id, "--json"]).await;
    assert_eq!(shown["key"], "demo:order-0");
    assert_eq!(shown["body"], r#"{"id":"order-0"}"#);
    assert_eq!(shown["deliveries"][0]["status"], 200);
    let by_key = json_of(
        &server,
        &["events", "show", "--key", "demo:order-0", "--json"],
    )
    .await;
    assert_eq!(by_key[0], shown);
    let (code, text, _) = run_capturing(&server, &["events", "show", &id]).await;
    assert_eq!(code, 0);
    assert!(
        text.contains("state:       delivered after 1 attempt"),
        "{text}"
    );
    assert!(text.ends_with("{\"id\":\"order-0\"}\n"), "{text}");

    // Mistakes are said: an unknown source, a cursor no listing gave, an unknown event.
    for (args, expected, code) in [
        (
            &["events", "list", "--source", "nope"][..],
            "no source is named \"nope\"",
            2,
        ),
        (&["events", "list", "--cursor", "x"][..], "--cursor", 2),
        (
            &["events", "list", "--since", "yesterday"][..],
            "yesterday",
            2,
        ),
        (
            &["events", "show", "999999"][..],
            "no event has id 999999",
            1,
        ),
    ] {
        let (status, _, stderr) = run_capturing(&server, args).await;
        assert_eq!(status, code, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    worker.pool().close().await;
    drop_database(db, &url).await;
}

async fn replay_says_what_it_would_do_and_with_yes_delivers_the_event_again<DB: TestBackend>(
    test: &str,
) {
    let (db, url, server, worker) = server_and_worker::<DB>(test).await;
    let key = receive(&worker, "order-1").await;
    let sink = Sink::start().await;
    deliver(&worker, &sink).await;
    let listed = json_of(&server, &["events", "list", "--json"]).await;
    let id = listed["events"][0]["id"].as_i64().unwrap().to_string();

    let (code, said, stderr) = run_capturing(&server, &["replay", &id]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(said.contains("would replay event"), "{said}");
    assert!(said.contains("--yes"), "{said}");
    let shown = json_of(&server, &["events", "show", &id, "--json"]).await;
    assert_eq!(shown["state"], "delivered", "nothing changed without --yes");

    let (code, said, stderr) = run_capturing(&server, &["replay", &id, "--yes"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(said.contains("is due again"), "{said}");
    let (code, _, stderr) = run_capturing(&server, &["replay", &id, "--yes"]).await;
    assert_eq!(code, 1, "a replay waiting is not doubled: {stderr}");
    assert!(
        stderr.contains("waits for its delivery already"),
        "{stderr}"
    );
    deliver(&worker, &sink).await;
    assert_eq!(per_key(&sink)[&key], 2);

    let (code, said, stderr) = run_capturing(&server, &["replay", "--key", &key, "--yes"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        said.starts_with("1 event with key demo:order-1 due again"),
        "{said}"
    );
    deliver(&worker, &sink).await;
    assert_eq!(per_key(&sink)[&key], 3);
    let received = sink.received();
    assert!(received.iter().all(|r| r.body == received[0].body));

    for (args, expected) in [
        (&["replay", "--source", "demo"][..], "needs --since"),
        (&["replay", "--since", "2h"][..], "--source"),
        (
            &["replay", "--consumer", "nope", "--since", "2h"][..],
            "no consumer is named",
        ),
    ] {
        let (status, _, stderr) = run_capturing(&server, args).await;
        assert_eq!(status, 2, "{args:?}: {stderr}");
        assert!(stderr.contains(expected), "{args:?}: {stderr}");
    }
    worker.pool().close().await;
    drop_database(db, &url).await;
}

/// The proof: 100 events received and delivered by the running service, replayed by time
/// range, reach the target each once more, with the same Idempotency-Key and body.
async fn a_time_range_replay_of_100_events_delivers_each_once_more_with_the_same_key<
    DB: TestBackend,
>(
    test: &str,
) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&url, &sink.url());
    server.start().await;
    let client = client();
    for n in 0..100 {
        let body = format!(r#"{{"id":"evt_{n}","n":{n}}}"#);
        assert_eq!(
            post(&client, &server.public, &body).await.unwrap(),
            (200, "accepted".into())
        );
    }
    await_requests(&sink, &server, 100).await;

    let range = ["replay", "--source", "demo", "--since", "1h"];
    let (code, said, stderr) = run_capturing(&server, &range).await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(
        said,
        "would replay 100 events delivered or dead; pass --yes to replay\n"
    );
    let (code, said, stderr) = run_capturing(&server, &[&range[..], &["--yes"]].concat()).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        said.contains(": 100 events of demo received from "),
        "{said}"
    );

    await_requests(&sink, &server, 200).await;
    let counts = per_key(&sink);
    assert_eq!(counts.len(), 100);
    assert!(counts.values().all(|&n| n == 2), "{counts:?}");
    let mut bodies: HashMap<String, Vec<Vec<u8>>> = HashMap::new();
    for request in sink.received() {
        let key = request.key.unwrap_or_default();
        bodies.entry(key).or_default().push(request.body);
    }
    assert!(
        bodies.values().all(|sent| sent[0] == sent[1]),
        "a replay's body differs from the first delivery's"
    );
    server.stop().await;
    drop_database(db, &url).await;
}

/// Waits until `sink` has `count` requests and the service has recorded each as delivered,
/// so that none is left to come.
async fn await_requests(sink: &Sink, server: &Server, count: usize) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        if sink.requests() >= count {
            let due = json_of(server, &["events", "list", "--state", "due", "--json"]).await;
            if keys_of(&due).is_empty() {
                assert_eq!(sink.requests(), count);
                return;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {count} requests",
            sink.requests()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn an_event_outlives_its_key_until_its_event_retention_ends<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let server = Server::configure_with(
        &url,
        "http://127.0.0.1:1/unused",
        "retry_horizon = \"1h\"\nretention = \"2h\"\nevent_retention = \"1d\"",
    );
    assert_eq!(server.run(&["migrate"]).await.0, 0);
    let worker = Inbox::<DB>::connect(&url, Consumer::new("worker").unwrap())
        .await
        .unwrap();
    let key = receive(&worker, "order-1").await;
    let sink = Sink::start().await;
    deliver(&worker, &sink).await;
    let id = json_of(&server, &["events", "list", "--json"]).await["events"][0]["id"]
        .as_i64()
        .unwrap()
        .to_string();
    // Three hours old: past the key's retention, within the event's.
    DB::age_key(worker.pool(), "justonce_", &key, 3 * 3_600_000).await;
    DB::age_rows(
        worker.pool(),
        "justonce_outbox".to_owned(),
        "received_at",
        3 * 3_600_000,
    )
    .await;
    let (code, said, stderr) = run_capturing(&server, &["purge", "--pause", "0"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(said, "purged 1 key and 0 sent deliveries\n");
    let (code, _, stderr) = run_capturing(&server, &["replay", &id, "--yes"]).await;
    assert_eq!(code, 0, "{stderr}");
    deliver(&worker, &sink).await;
    assert_eq!(per_key(&sink)[&key], 2, "replayed after its key was purged");

    // Two days old: past the event's retention.
    DB::age_rows(
        worker.pool(),
        "justonce_outbox".to_owned(),
        "received_at",
        2 * 86_400_000,
    )
    .await;
    let (code, said, stderr) = run_capturing(&server, &["purge", "--pause", "0"]).await;
    assert_eq!(code, 0, "{stderr}");
    assert_eq!(said, "purged 0 keys and 1 sent delivery\n");
    let (code, _, stderr) = run_capturing(&server, &["events", "show", &id]).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("no event has id"), "{stderr}");
    worker.pool().close().await;
    drop_database(db, &url).await;
}
