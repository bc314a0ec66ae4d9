//! `serve --role`: processes on one database that each run part of the service.

use crate::serve::{
    Server, await_keys, client, database, drop_database, post, stats_json, text_of, usage_error,
};
use justonce_tests::{Answer, Sink, TestBackend};
use std::sync::Arc;
use std::time::Duration;

on_every_database!(
    a_receiver_stores_and_a_relay_elsewhere_delivers_each_event_once,
    a_relay_capped_at_one_per_destination_sends_one_delivery_at_a_time,
);

/// A receiver-only process answers and stores each event but delivers none; a relay-only
/// process on the same database, with no public listener, delivers each of them once.
/// Each says on `/readyz` and `/metrics` which roles it runs.
async fn a_receiver_stores_and_a_relay_elsewhere_delivers_each_event_once<DB: TestBackend>(
    test: &str,
) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let client = client();
    let mut receiver = Server::configure(&url, &sink.url());
    receiver.start_with(&["--role", "receiver"]).await;
    for n in 0..20 {
        let body = format!(r#"{{"id":"evt_{n}"}}"#);
        let first = post(&client, &receiver.public, &body).await.unwrap();
        assert_eq!(first, (200, "accepted".into()));
        let again = post(&client, &receiver.public, &body).await.unwrap();
        assert_eq!(again, (200, "duplicate".into()));
    }
    let (_, ready) = readyz(&client, &receiver).await;
    assert_eq!(ready["roles"], serde_json::json!(["receiver"]));
    let metrics = text_of(&client, &format!("{}/metrics", receiver.admin)).await;
    assert!(
        metrics.contains("justonce_role{role=\"receiver\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("justonce_role{role=\"relay\"} 0"),
        "{metrics}"
    );
    // No relay runs: a relay would deliver within milliseconds.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(sink.received().len(), 0);
    let stats = stats_json(&receiver).await;
    assert_eq!(
        stats["deliveries"],
        serde_json::json!({"sent": 0, "due": 20, "dead": 0})
    );

    let mut relay = Server::configure(&url, &sink.url());
    relay.start_with(&["--role", "relay"]).await;
    let refused = client.get(format!("{}/livez", relay.public)).send().await;
    assert!(
        refused.is_err(),
        "a relay-only process opened its public listener"
    );
    let (_, ready) = readyz(&client, &relay).await;
    assert_eq!(ready["roles"], serde_json::json!(["relay"]));
    let by_key = await_keys(&sink, 20).await;
    assert_eq!(by_key.len(), 20);
    for n in 0..20 {
        let bodies = &by_key[&format!("demo:evt_{n}")];
        assert_eq!(
            bodies.len(),
            1,
            "evt_{n} was delivered {} times",
            bodies.len()
        );
    }
    let mut stats = serde_json::Value::Null;
    for _ in 0..100 {
        stats = stats_json(&relay).await;
        if stats["deliveries"]["sent"] == 20 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        stats["deliveries"],
        serde_json::json!({"sent": 20, "due": 0, "dead": 0})
    );
    receiver.stop().await;
    relay.stop().await;
    drop_database(db, &url).await;
}

/// `server.relay_per_destination = 1` holds a target to one delivery in flight: with every
/// event stored before the relay starts, each arrives only after the one before it was
/// answered, where the default cap of 8 would send them together.
async fn a_relay_capped_at_one_per_destination_sends_one_delivery_at_a_time<DB: TestBackend>(
    test: &str,
) {
    const EVENTS: usize = 5;
    const ANSWER_AFTER: Duration = Duration::from_millis(300);
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::scripted(Arc::new(|_, _| Answer {
        delay: ANSWER_AFTER,
        ..Answer::status(200)
    }))
    .await;
    let client = client();
    let mut receiver = Server::configure(&url, &sink.url());
    receiver.start_with(&["--role", "receiver"]).await;
    for n in 0..EVENTS {
        let body = format!(r#"{{"id":"evt_{n}"}}"#);
        let answer = post(&client, &receiver.public, &body).await.unwrap();
        assert_eq!(answer, (200, "accepted".into()));
    }
    // The total stays at its default: only the cap per tenant holds the target back.
    let mut relay = Server::configure_all(&url, &sink.url(), "relay_per_destination = 1", "");
    relay.start_with(&["--role", "relay"]).await;
    let by_key = await_keys(&sink, EVENTS).await;
    assert_eq!(by_key.len(), EVENTS);
    assert!(
        by_key.values().all(|bodies| bodies.len() == 1),
        "{by_key:?}"
    );
    let arrivals: Vec<_> = sink.received().iter().map(|request| request.at).collect();
    for (n, pair) in arrivals.windows(2).enumerate() {
        let gap = pair[1].duration_since(pair[0]);
        assert!(
            gap >= ANSWER_AFTER,
            "delivery {} came {gap:?} after the one before, which was still unanswered",
            n + 2
        );
    }
    receiver.stop().await;
    relay.stop().await;
    drop_database(db, &url).await;
}

/// A role the service does not have is refused with the list of those it has, as a bad
/// command line (exit code 2) or a bad setting.
#[tokio::test]
async fn an_unknown_role_is_refused_naming_the_roles() {
    let server = Server::configure("sqlite::memory:", "http://127.0.0.1:9/");
    let stderr = usage_error(&mut server.command(&["serve", "--role", "receiver,reporter"])).await;
    assert!(
        stderr.contains("\"reporter\" is not a role")
            && stderr.contains("receiver, relay, consumers and purge"),
        "{stderr}"
    );
    let stderr = usage_error(
        server
            .command(&["serve"])
            .env("JUSTONCE_SERVER_ROLES", "relay,,purge"),
    )
    .await;
    assert!(
        stderr.contains("server.roles") && stderr.contains("\"\" is not a role"),
        "{stderr}"
    );
}

/// A process without the consumers role does not connect its consumers, so a broker it
/// cannot reach leaves it ready; with the role, the same configuration is not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_without_the_consumers_role_neither_connects_nor_waits_for_them() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("roles-consumers").await;
    let broker = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        crate::serve::free_port()
    );
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{broker}\"\nqueue = \"{}orders\"\ntarget = \"http://127.0.0.1:1/x\"\n",
        db.prefix
    );
    let client = client();
    let mut without = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    without
        .start_with(&["--role", "receiver,relay,purge"])
        .await;
    let (status, ready) = readyz(&client, &without).await;
    assert_eq!(status, 200);
    assert_eq!(ready["consumers"], serde_json::json!({}));
    assert_eq!(
        ready["roles"],
        serde_json::json!(["receiver", "relay", "purge"])
    );
    without.stop().await;

    let mut with = Server::configure_with(&url, "http://127.0.0.1:1/x", &consumer);
    with.start().await;
    let (status, problem) = readyz(&client, &with).await;
    assert_eq!(status, 503);
    assert_eq!(problem["consumers"]["orders"], "connecting");
    assert_eq!(
        problem["roles"],
        serde_json::json!(["receiver", "relay", "consumers", "purge"])
    );
    with.stop().await;
    drop_database(db, &url).await;
}

/// The status and the body of the admin listener's `/readyz`.
async fn readyz(client: &reqwest::Client, server: &Server) -> (u16, serde_json::Value) {
    let answer = client
        .get(format!("{}/readyz", server.admin))
        .send()
        .await
        .unwrap();
    let status = answer.status().as_u16();
    (
        status,
        serde_json::from_str(&answer.text().await.unwrap()).unwrap(),
    )
}
