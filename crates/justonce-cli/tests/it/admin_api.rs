//! The admin API against the running service: each route's answer is what the store
//! holds, its changes reach the store and the target (a replay with the same key), and
//! access is refused as documented.

use crate::serve::{
    CLOSED_PORT, Server, claim_with_delivery, client, database, drop_database, signature,
};
use justonce_sql::{
    Consumer, Fingerprint, Identity, Inbox, KEY_CONTAINS_WINDOW, Key, LeaseClaim, Leases, Scope,
};
use justonce_tests::{Answer, Sink, TestBackend};
use reqwest::Method;
use serde_json::{Value, json};
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

on_every_database!(
    every_admin_route_answers_with_what_the_store_holds,
    replays_through_the_api_deliver_each_event_once_more_with_the_same_key,
);

pub(crate) const TOKEN: &str = "an admin token long enough to guess never";

/// A server with `server.admin_token` set, delivering to `sink`, with `more` at the end of
/// its configuration; and its log.
pub(crate) async fn server_with_token(
    url: &str,
    sink: &Sink,
    more: &str,
) -> (Server, tokio::task::JoinHandle<Vec<String>>) {
    let mut server =
        Server::configure_all(url, &sink.url(), "admin_token = \"env:ADMIN_TOKEN\"", more);
    let log = server
        .start_logged(&[], &[("ADMIN_TOKEN", TOKEN), ("RUST_LOG", "warn")])
        .await;
    (server, log)
}

/// A client of one server's admin API, sending the token unless told otherwise.
pub(crate) struct Api {
    client: reqwest::Client,
    admin: String,
}

impl Api {
    pub(crate) fn of(server: &Server) -> Self {
        Self {
            client: client(),
            admin: server.admin.clone(),
        }
    }

    fn request(&self, method: Method, path: &str) -> reqwest::RequestBuilder {
        self.client
            .request(method, format!("{}{path}", self.admin))
            .timeout(Duration::from_secs(30))
    }

    /// With the token: the status and the JSON answer.
    async fn call(&self, method: Method, path: &str) -> (u16, Value) {
        answer_of(
            self.request(method, path)
                .header("authorization", format!("Bearer {TOKEN}")),
        )
        .await
    }

    pub(crate) async fn get(&self, path: &str) -> Value {
        let (status, body) = self.call(Method::GET, path).await;
        assert_eq!(status, 200, "GET {path}: {body}");
        body
    }

    async fn post(&self, path: &str) -> Value {
        let (status, body) = self.call(Method::POST, path).await;
        assert_eq!(status, 200, "POST {path}: {body}");
        body
    }
}

/// The status and JSON body of a request; a failure must be problem+json with its status.
async fn answer_of(request: reqwest::RequestBuilder) -> (u16, Value) {
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .map(|value| value.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let text = response.text().await.unwrap();
    let body: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    if status >= 400 {
        assert_eq!(content_type, "application/problem+json", "{text}");
        assert_eq!(body["status"], status, "{text}");
    } else {
        assert_eq!(content_type, "application/json", "{text}");
    }
    (status, body)
}

/// A `400` that names `parameter`.
async fn assert_bad(api: &Api, method: Method, path: &str, parameter: &str) {
    let (status, body) = api.call(method, path).await;
    assert_eq!(
        (status, body["parameter"].as_str()),
        (400, Some(parameter)),
        "{path}: {body}"
    );
}

/// Asks `check` again until it gives a value, for at most a minute.
async fn until<T, F: Future<Output = Option<T>>>(what: &str, check: impl FnMut() -> F) -> T {
    within_a_minute(check)
        .await
        .unwrap_or_else(|| panic!("waited a minute for {what}"))
}

/// Asks `check` again until it gives a value; `None` after a minute.
async fn within_a_minute<T, F: Future<Output = Option<T>>>(
    mut check: impl FnMut() -> F,
) -> Option<T> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some(value) = check().await {
            return Some(value);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) async fn post_event(server: &Server, source: &str, body: &str) {
    let status = client()
        .post(format!("{}/webhooks/{source}", server.public))
        .header("content-type", "application/json")
        .header("x-signature", signature(body))
        .body(body.to_owned())
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 200, "{source}: {body}");
}

fn ids(page: &Value) -> Vec<i64> {
    let items = page["items"].as_array().unwrap();
    items
        .iter()
        .map(|item| item["id"].as_i64().unwrap())
        .collect()
}

fn keys(page: &Value) -> Vec<String> {
    let items = page["items"].as_array().unwrap();
    items
        .iter()
        .map(|item| item["key"].as_str().unwrap().to_owned())
        .collect()
}

/// How many requests with `key` the sink has answered.
pub(crate) fn requests_with(sink: &Sink, key: &str) -> Vec<Vec<u8>> {
    let received = sink.received().into_iter();
    received
        .filter(|r| r.key.as_deref() == Some(key))
        .map(|r| r.body)
        .collect()
}

/// A lease for an hour on `key` of `inbox`'s consumer in `scope`.
async fn lease<DB: TestBackend>(inbox: &Inbox<DB>, scope: Scope, key: &str) -> Identity {
    let identity = Identity::new(scope, inbox.consumer().clone(), Key::new(key).unwrap());
    let claim = inbox
        .claim_lease(&identity, &Fingerprint::of(key), Duration::from_secs(3600))
        .await
        .unwrap();
    assert!(matches!(claim, LeaseClaim::Acquired(_)), "{claim:?}");
    identity
}

/// Five webhooks of two sources are refused once by their target and dead-lettered; a
/// worker holds leases; a consumer's broker is down. Every route reads that as stored,
/// and its changes are stored and reach the target again with the same key.
async fn every_admin_route_answers_with_what_the_store_holds<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    // Each key's first delivery is refused, so that it is dead-lettered; a replay is taken.
    let sink = Sink::scripted(Arc::new(|_, attempt| {
        Answer::status(if attempt == 1 { 400 } else { 200 })
    }))
    .await;
    let more = format!(
        r#"
[sources.shop]
scheme = "hmac-sha256"
secrets = ["env:DEMO_SECRET"]
id = "json:/id"
target = "{sink}"

[consumers.orders]
from = "amqp://guest:guest@127.0.0.1:{closed}/%2f"
queue = "orders"
target = "http://127.0.0.1:{closed}/unreachable"
"#,
        sink = sink.url(),
        closed = CLOSED_PORT,
    );
    let (mut server, log) = server_with_token(&url, &sink, &more).await;
    let api = Api::of(&server);
    let body = |n: u32| format!(r#"{{"id":"evt_{n}","n":{n}}}"#);
    for n in 1..=3 {
        post_event(&server, "demo", &body(n)).await;
    }
    for n in 1..=2 {
        post_event(&server, "shop", &body(n)).await;
    }
    let all = until("five dead letters", || async {
        let page = api.get("/api/v1/dead-letters").await;
        (ids(&page).len() == 5).then_some(page)
    })
    .await;
    assert_eq!(all["next_cursor"], Value::Null);
    let all_ids = ids(&all);
    assert!(all_ids.is_sorted(), "oldest first: {all_ids:?}");
    let mut all_keys = keys(&all);
    all_keys.sort();
    assert_eq!(
        all_keys,
        [
            "demo:evt_1",
            "demo:evt_2",
            "demo:evt_3",
            "shop:evt_1",
            "shop:evt_2"
        ]
    );
    let first = &all["items"][0];
    assert_eq!(first["attempts"], 1);
    assert!(
        first["last_error"].as_str().unwrap().contains("400"),
        "{first}"
    );

    // Access: the token in the Authorization header only.
    let list = "/api/v1/dead-letters";
    for request in [
        api.request(Method::GET, list),
        api.request(Method::GET, list)
            .header("authorization", "Bearer not-the-token"),
        api.request(Method::GET, &format!("{list}?access_token={TOKEN}")),
        api.request(Method::GET, list)
            .header("cookie", format!("token={TOKEN}")),
        api.request(Method::POST, "/api/v1/dead-letters/replay?all=true"),
    ] {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 401);
        assert_eq!(response.headers()["www-authenticate"], "Bearer");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
    }
    let (status, refused) = answer_of(
        api.request(Method::POST, "/api/v1/dead-letters/replay?all=true")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("origin", "https://elsewhere.example"),
    )
    .await;
    assert_eq!(status, 403, "{refused}");
    assert_eq!(
        ids(&api.get(list).await),
        all_ids,
        "a refused change changes nothing"
    );

    // Pages by cursor, and the filters.
    let mut paged = Vec::new();
    let mut cursor = String::new();
    for expected in [2, 2, 1] {
        let page = api.get(&format!("{list}?limit=2{cursor}")).await;
        assert_eq!(ids(&page).len(), expected, "{page}");
        paged.extend(ids(&page));
        cursor = match page["next_cursor"].as_str() {
            Some(next) => format!("&cursor={next}"),
            None => String::new(),
        };
    }
    assert_eq!(cursor, "", "the last page has no next cursor");
    assert_eq!(paged, all_ids);
    let shop = api.get(&format!("{list}?destination=shop")).await;
    assert_eq!(keys(&shop), ["shop:evt_1", "shop:evt_2"]);
    assert_eq!(ids(&api.get(&format!("{list}?since=1h")).await), all_ids);
    assert!(ids(&api.get(&format!("{list}?until=1h")).await).is_empty());
    assert_bad(&api, Method::GET, &format!("{list}?limit=0"), "limit").await;
    assert_bad(&api, Method::GET, &format!("{list}?since=soon"), "since").await;
    assert_bad(&api, Method::GET, &format!("{list}?colour=red"), "colour").await;
    assert_bad(&api, Method::GET, &format!("{list}?cursor=abc"), "cursor").await;

    // One delivery with its stored body and attempt.
    let evt_1 = all["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["key"] == "demo:evt_1")
        .unwrap()["id"]
        .as_i64()
        .unwrap();
    let shown = api.get(&format!("/api/v1/deliveries/{evt_1}")).await;
    assert_eq!(
        (
            &shown["key"],
            &shown["destination"],
            &shown["state"],
            &shown["attempts"]
        ),
        (
            &json!("demo:evt_1"),
            &json!("demo"),
            &json!("dead"),
            &json!(1)
        )
    );
    assert_eq!(shown["body"], body(1));
    assert_eq!(shown["history"].as_array().unwrap().len(), 1, "{shown}");
    assert_eq!(shown["history"][0]["status"], 400);
    let (status, _) = api.call(Method::GET, "/api/v1/deliveries/999999999").await;
    assert_eq!(status, 404);
    assert_bad(&api, Method::GET, "/api/v1/deliveries/abc", "id").await;

    // Replay one, sent from the admin API's own origin: the target gets it again, with
    // the same key and body.
    let replayed = answer_of(
        api.request(
            Method::POST,
            &format!("/api/v1/dead-letters/{evt_1}/replay"),
        )
        .header("authorization", format!("Bearer {TOKEN}"))
        .header("origin", &server.admin),
    )
    .await;
    assert_eq!(replayed, (200, json!({"id": evt_1, "replayed": 1})));
    let bodies = until("the replayed delivery", || async {
        let bodies = requests_with(&sink, "demo:evt_1");
        (bodies.len() == 2).then_some(bodies)
    })
    .await;
    assert_eq!(bodies, [body(1).into_bytes(), body(1).into_bytes()]);
    let sent = until("the replay recorded as sent", || async {
        let shown = api.get(&format!("/api/v1/deliveries/{evt_1}")).await;
        (shown["state"] == "sent").then_some(shown)
    })
    .await;
    let statuses: Vec<&Value> = sent["history"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| &a["status"])
        .collect();
    assert_eq!(statuses, [&json!(400), &json!(200)]);
    let (status, conflict) = api
        .call(
            Method::POST,
            &format!("/api/v1/dead-letters/{evt_1}/replay"),
        )
        .await;
    assert_eq!(
        status, 409,
        "a sent delivery is not replayed as a dead letter: {conflict}"
    );
    let (status, _) = api
        .call(Method::POST, "/api/v1/dead-letters/999999999/replay")
        .await;
    assert_eq!(status, 404);

    // Replay and purge by filter; neither without a filter or all=true.
    assert_bad(&api, Method::POST, "/api/v1/dead-letters/replay", "all").await;
    assert_bad(&api, Method::DELETE, "/api/v1/dead-letters", "all").await;
    assert_bad(
        &api,
        Method::DELETE,
        "/api/v1/dead-letters?all=true&destination=demo",
        "all",
    )
    .await;
    assert_eq!(
        api.post("/api/v1/dead-letters/replay?destination=shop")
            .await,
        json!({"replayed": 2})
    );
    for key in ["shop:evt_1", "shop:evt_2"] {
        until(key, || async {
            (requests_with(&sink, key).len() == 2).then_some(())
        })
        .await;
    }
    let (status, purged) = api
        .call(Method::DELETE, "/api/v1/dead-letters?destination=demo")
        .await;
    assert_eq!((status, purged), (200, json!({"purged": 2})));
    assert!(ids(&api.get(list).await).is_empty());

    // Keys: shown, released and completed as the store holds them.
    let worker = Inbox::<DB>::connect(&url, Consumer::new("worker").unwrap())
        .await
        .unwrap();
    let done = api.get("/api/v1/keys/demo/demo:evt_1").await;
    assert_eq!(
        (
            &done["state"],
            &done["consumer"],
            &done["scope"],
            &done["result"]
        ),
        (&json!("done"), &json!("demo"), &Value::Null, &Value::Null)
    );
    assert_eq!(done["lease_remaining_seconds"], Value::Null);
    assert_eq!(done["fingerprint"].as_str().unwrap().len(), 64);
    let stuck = lease(&worker, Scope::none(), "charge:1").await;
    let held = api.get("/api/v1/keys/worker/charge:1").await;
    assert_eq!(held["state"], "in_progress");
    assert!(
        held["lease_remaining_seconds"].as_f64().unwrap() > 3_000.0,
        "{held}"
    );
    let released = api.post("/api/v1/keys/worker/charge:1/release").await;
    assert_eq!(released["lease_remaining_seconds"], 0.0);
    let stored = worker.lookup(&stuck).await.unwrap().unwrap();
    assert_eq!(stored.lease_remaining, Some(Duration::ZERO));
    let tenant = Scope::new("tenant-a").unwrap();
    let in_tenant = lease(&worker, tenant, "charge:2").await;
    let (status, _) = api.call(Method::GET, "/api/v1/keys/worker/charge:2").await;
    assert_eq!(status, 404, "the key is stored in its tenant's scope only");
    let completed = answer_of(
        api.request(
            Method::POST,
            "/api/v1/keys/worker/charge:2/complete?scope=tenant-a",
        )
        .header("authorization", format!("Bearer {TOKEN}"))
        .body(r#"{"result":"receipt-7"}"#),
    )
    .await;
    assert_eq!(completed.0, 200, "{}", completed.1);
    assert_eq!(
        (
            &completed.1["state"],
            &completed.1["scope"],
            &completed.1["result"]
        ),
        (&json!("done"), &json!("tenant-a"), &json!("receipt-7"))
    );
    let stored = worker.lookup(&in_tenant).await.unwrap().unwrap();
    assert_eq!(
        (stored.lease_remaining, stored.result),
        (None, Some(b"receipt-7".to_vec()))
    );
    let (status, _) = api
        .call(
            Method::POST,
            "/api/v1/keys/worker/charge:2/complete?scope=tenant-a",
        )
        .await;
    assert_eq!(status, 409, "a done key has no lease to complete");
    let (status, _) = api
        .call(Method::POST, "/api/v1/keys/worker/never/release")
        .await;
    assert_eq!(status, 404);
    assert_bad(&api, Method::GET, "/api/v1/keys/bad%01name/k", "consumer").await;
    let (status, bad_body) = answer_of(
        api.request(Method::POST, "/api/v1/keys/worker/charge:1/complete")
            .header("authorization", format!("Bearer {TOKEN}"))
            .body("receipt"),
    )
    .await;
    assert_eq!(
        (status, bad_body["parameter"].as_str()),
        (400, Some("body"))
    );

    // The consumer whose broker is down, its offsets and its delivery waiting.
    let orders = worker.with_consumer(Consumer::new("orders").unwrap());
    let mut tx = orders.begin().await.unwrap();
    let committed = orders
        .commit_offset(&mut tx, "orders", 0, justonce_sql::Offset::from(41))
        .await
        .unwrap();
    assert_eq!(committed, justonce_sql::OffsetCommit::Moved);
    tx.commit().await.unwrap();
    claim_with_delivery(&orders, "o-1", "orders").await;
    let failed = within_a_minute(|| async {
        let consumers = api.get("/api/v1/consumers").await;
        consumers["consumers"][0]["last_error"]
            .is_string()
            .then_some(consumers)
    });
    let Some(consumers) = failed.await else {
        // What serve logged says whether its consumer tried at all.
        server.kill().await;
        let logged = log.await.unwrap_or_default().join("\n");
        panic!("waited a minute for the consumer's failed connection; serve logged:\n{logged}");
    };
    let orders_state = &consumers["consumers"][0];
    assert_eq!(consumers["consumers"].as_array().unwrap().len(), 1);
    assert_eq!(
        (&orders_state["name"], &orders_state["connection"]),
        (&json!("orders"), &json!("connecting"))
    );
    assert_eq!(
        orders_state["offsets"],
        json!([{"stream": "orders", "partition": 0, "position": 41, "sequence": 0}])
    );
    let deliveries = &orders_state["deliveries"];
    assert_eq!(
        (&deliveries["due"], &deliveries["dead"], &deliveries["sent"]),
        (&json!(1), &json!(0), &json!(0))
    );

    // The store's counts.
    let stats = until("the replays recorded", || async {
        let stats = api.get("/api/v1/stats").await;
        (stats["deliveries"]["sent"] == 3).then_some(stats)
    })
    .await;
    assert_eq!(
        (&stats["deliveries"]["due"], &stats["deliveries"]["dead"]),
        (&json!(1), &json!(0))
    );
    assert_eq!(
        stats["keys"],
        json!([
            {"consumer": "demo", "scope": null, "keys": 3, "in_progress": 0},
            {"consumer": "orders", "scope": null, "keys": 1, "in_progress": 0},
            {"consumer": "shop", "scope": null, "keys": 2, "in_progress": 0},
            {"consumer": "worker", "scope": null, "keys": 1, "in_progress": 1},
            {"consumer": "worker", "scope": "tenant-a", "keys": 1, "in_progress": 0},
        ])
    );
    assert_eq!(stats["offsets"][0]["consumer"], "orders");

    // Events: listed by origin and state a page at a time, shown whole, replayed one or by
    // time range with their own keys.
    let listed = api.get("/api/v1/events?source=shop").await;
    let events = listed["events"].as_array().unwrap();
    let event_keys: Vec<&str> = events.iter().map(|e| e["key"].as_str().unwrap()).collect();
    assert_eq!(event_keys, ["shop:evt_1", "shop:evt_2"]);
    assert!(events.iter().all(|e| e["state"] == "delivered"), "{listed}");
    let first_page = api.get("/api/v1/events?source=shop&limit=1").await;
    assert_eq!(first_page["events"][0]["key"], "shop:evt_1");
    let next = first_page["next_cursor"].as_str().unwrap();
    let second_page = api
        .get(&format!("/api/v1/events?source=shop&limit=1&cursor={next}"))
        .await;
    assert_eq!(second_page["events"][0]["key"], "shop:evt_2");
    let shop_1 = events[0]["id"].as_i64().unwrap();
    let shown = api.get(&format!("/api/v1/events/{shop_1}")).await;
    assert_eq!(
        (&shown["origin"], &shown["body"]),
        (&json!("shop"), &json!(body(1)))
    );
    assert!(
        !shown["deliveries"].as_array().unwrap().is_empty(),
        "{shown}"
    );
    let waiting = api.get("/api/v1/events?consumer=orders&state=due").await;
    let waiting = waiting["events"][0]["id"].as_i64().unwrap();
    let (status, _) = api
        .call(Method::POST, &format!("/api/v1/events/{waiting}/replay"))
        .await;
    assert_eq!(
        status, 409,
        "an event waiting for its delivery is not replayed twice"
    );
    let window = api.post("/api/v1/events/replay?source=shop&since=1h").await;
    assert_eq!(
        (&window["origin"], &window["events"]),
        (&json!("shop"), &json!(2))
    );
    for key in ["shop:evt_1", "shop:evt_2"] {
        until(key, || async {
            (requests_with(&sink, key).len() == 3).then_some(())
        })
        .await;
    }
    let (status, _) = api.call(Method::GET, "/api/v1/events/999999999").await;
    assert_eq!(status, 404);
    assert_bad(&api, Method::GET, "/api/v1/events?state=lost", "state").await;
    assert_bad(
        &api,
        Method::GET,
        "/api/v1/events?source=shop&consumer=orders",
        "consumer",
    )
    .await;
    assert_bad(
        &api,
        Method::GET,
        "/api/v1/events?cursor=nonsense",
        "cursor",
    )
    .await;
    assert_bad(
        &api,
        Method::POST,
        "/api/v1/events/replay?source=shop",
        "since",
    )
    .await;
    // A name the configuration does not have is said, not answered with no events.
    for (method, path, parameter) in [
        (Method::GET, "/api/v1/events?source=shoe", "source"),
        (Method::GET, "/api/v1/events?consumer=order", "consumer"),
        (Method::GET, "/api/v1/events?source=orders", "source"),
        (
            Method::POST,
            "/api/v1/events/replay?source=shoe&since=1h",
            "source",
        ),
        (
            Method::POST,
            "/api/v1/events/replay?consumer=shop&since=1h",
            "consumer",
        ),
    ] {
        assert_bad(&api, method, path, parameter).await;
    }

    // With the token set, a request for any host name is answered.
    let (status, _) = answer_of(
        api.request(Method::GET, "/api/v1/stats")
            .header("authorization", format!("Bearer {TOKEN}"))
            .header("host", "rebound.example"),
    )
    .await;
    assert_eq!(status, 200);

    // The document, without a token, as the repository keeps it; other paths are problems.
    let served = client()
        .get(format!("{}/openapi.json", server.admin))
        .send()
        .await
        .unwrap();
    assert_eq!(served.status(), 200);
    assert_eq!(served.text().await.unwrap(), openapi_file());
    let (status, _) = api.call(Method::GET, "/api/v1/nothing").await;
    assert_eq!(status, 404);
    let (status, _) = api.call(Method::PUT, "/api/v1/stats").await;
    assert_eq!(status, 405);

    worker.pool().close().await;
    server.stop().await;
    drop_database(db, &url).await;
}

/// Waits until the sink has answered `count` requests and the service has recorded each
/// as delivered, so that none is left to come: then it has exactly `count`.
async fn await_delivered(api: &Api, sink: &Sink, count: usize) {
    until(&format!("{count} deliveries"), || async {
        let due = api.get("/api/v1/events?state=due").await;
        let settled = sink.requests() >= count && due["events"].as_array().unwrap().is_empty();
        settled.then_some(())
    })
    .await;
    assert_eq!(sink.requests(), count);
}

/// How many requests the sink received for each Idempotency-Key.
fn per_key(sink: &Sink) -> std::collections::HashMap<String, usize> {
    let mut counts = std::collections::HashMap::new();
    for request in sink.received() {
        *counts.entry(request.key.unwrap_or_default()).or_default() += 1;
    }
    counts
}

/// A hundred webhooks delivered to a real target; a replay of their time range through the
/// API delivers each once more and only once more, with the same Idempotency-Key and body;
/// the replay is listed; a replay by key delivers that event once more. An event whose
/// body is not text is shown by the API and `events show --json` alike.
async fn replays_through_the_api_deliver_each_event_once_more_with_the_same_key<DB: TestBackend>(
    test: &str,
) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let (mut server, _log) = server_with_token(&url, &sink, "").await;
    let api = Api::of(&server);
    for n in 0..100 {
        post_event(&server, "demo", &format!(r#"{{"id":"evt_{n}","n":{n}}}"#)).await;
    }
    await_delivered(&api, &sink, 100).await;

    let window = api.post("/api/v1/events/replay?source=demo&since=1h").await;
    assert_eq!(
        (&window["origin"], &window["events"]),
        (&json!("demo"), &json!(100))
    );
    await_delivered(&api, &sink, 200).await;
    let counts = per_key(&sink);
    assert_eq!(counts.len(), 100);
    assert!(counts.values().all(|&n| n == 2), "{counts:?}");
    let mut bodies: std::collections::HashMap<String, Vec<Vec<u8>>> = Default::default();
    for request in sink.received() {
        bodies
            .entry(request.key.unwrap_or_default())
            .or_default()
            .push(request.body);
    }
    assert!(
        bodies.values().all(|sent| sent[0] == sent[1]),
        "a replay's body differs from the first delivery's"
    );
    let replays = api.get("/api/v1/replays").await;
    let listed = &replays["replays"][0];
    assert_eq!(
        (&listed["id"], &listed["events"], &listed["running"]),
        (&window["id"], &json!(100), &json!(false))
    );
    assert_bad(&api, Method::GET, "/api/v1/replays?limit=0", "limit").await;

    let by_key = api.post("/api/v1/events/replay?key=demo:evt_7").await;
    assert_eq!(by_key, json!({"key": "demo:evt_7", "replayed": 1}));
    await_delivered(&api, &sink, 201).await;
    let counts = per_key(&sink);
    assert_eq!(counts["demo:evt_7"], 3);
    assert_eq!(counts.values().filter(|&&n| n == 2).count(), 99);
    let (status, _) = api
        .call(Method::POST, "/api/v1/events/replay?key=demo:none")
        .await;
    assert_eq!(status, 404);
    assert_bad(
        &api,
        Method::POST,
        "/api/v1/events/replay?key=demo:evt_7&since=1h",
        "since",
    )
    .await;

    // A body that is not text: `body_base64` from the API and from the command.
    let worker = Inbox::<DB>::connect(&url, Consumer::new("worker").unwrap())
        .await
        .unwrap();
    let binary = [0xff, 0xfe, 0x00, 0x01];
    let outcome = worker
        .run_forward(
            &Key::new("binary:1").unwrap(),
            &binary,
            justonce_sql::Message::new("binary", binary.to_vec()),
        )
        .await
        .unwrap();
    assert!(matches!(outcome, justonce_sql::Outcome::Processed(())));
    let listed = api.get("/api/v1/events?key_prefix=binary:").await;
    let id = listed["events"][0]["id"].as_i64().unwrap().to_string();
    // `key` finds a part anywhere in the key; `%` and `_` are the characters themselves.
    let found = |listed: Value| listed["events"].as_array().unwrap().len();
    assert_eq!(
        found(api.get("/api/v1/events?key=evt_9&limit=1000").await),
        11
    );
    assert_eq!(found(api.get("/api/v1/events?key=_&limit=1000").await), 100);
    assert_eq!(found(api.get("/api/v1/events?key=%25&limit=1000").await), 0);
    assert_eq!(found(api.get("/api/v1/events?key=ry:1").await), 1);
    // No index serves `key`: without `since` the answer names the day it searched.
    let before = SystemTime::now();
    let searched = api.get("/api/v1/events?key=ry:1").await["searched_since"].clone();
    let searched = searched.as_str().expect("the window searched");
    let since = justonce_cli_support::parse_time(searched, before).unwrap();
    let window = before.duration_since(since).unwrap();
    let minute = Duration::from_secs(60);
    assert!(
        window.abs_diff(KEY_CONTAINS_WINDOW) < minute,
        "searched since {searched}"
    );
    let bounded = api.get("/api/v1/events?key=ry:1&since=1h").await;
    assert_eq!(
        (found(bounded.clone()), &bounded["searched_since"]),
        (1, &Value::Null)
    );
    assert_eq!(
        listed["searched_since"],
        Value::Null,
        "a prefix needs no window"
    );
    assert_bad(&api, Method::GET, "/api/v1/events?key=%00", "key").await;
    assert_bad(
        &api,
        Method::GET,
        "/api/v1/events?key_prefix=a%0A",
        "key_prefix",
    )
    .await;
    let from_api = api.get(&format!("/api/v1/events/{id}")).await;
    let output = server
        .command(&["events", "show", &id, "--json"])
        .env("ADMIN_TOKEN", TOKEN)
        .output()
        .await
        .unwrap();
    assert!(output.status.success(), "{output:?}");
    let from_command: Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(from_api["body_base64"], "//4AAQ==");
    assert_eq!(from_command["body_base64"], from_api["body_base64"]);
    let fields = |shown: &Value| {
        let mut names: Vec<String> = shown.as_object().unwrap().keys().cloned().collect();
        names.sort();
        names
    };
    assert_eq!(fields(&from_command), fields(&from_api));
    assert!(from_api.get("body").is_none(), "{from_api}");

    worker.pool().close().await;
    server.stop().await;
    drop_database(db, &url).await;
}

fn openapi_file() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    std::fs::read_to_string(path).unwrap()
}

/// Without `server.admin_token`, reads answer requests for the listener's own names only,
/// and every change is refused with a `403` that says what to set, whatever the request
/// carries. A page whose name was made to point at the listener (DNS rebinding) names
/// itself in `Host`, and is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_reads_answer_for_the_listeners_own_names_and_changes_are_refused() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("admin_api_without_token").await;
    let mut server = Server::configure(&url, "http://127.0.0.1:1/unused");
    server.start().await;
    let api = Api::of(&server);
    let (status, stats) = answer_of(api.request(Method::GET, "/api/v1/stats")).await;
    assert_eq!(status, 200);
    assert_eq!(stats["deliveries"]["dead"], 0);
    let port = server.admin.rsplit(':').next().unwrap();
    for host in [format!("localhost:{port}"), "[::1]".to_owned()] {
        let request = api
            .request(Method::GET, "/api/v1/events")
            .header("host", &host);
        let (status, page) = answer_of(request).await;
        assert_eq!(status, 200, "{host}: {page}");
    }
    for host in [
        format!("evil.example:{port}"),
        "evil.example".to_owned(),
        format!("127.0.0.1.evil.example:{port}"),
    ] {
        let request = api
            .request(Method::GET, "/api/v1/events")
            .header("host", &host);
        let (status, refused) = answer_of(request).await;
        assert_eq!(status, 403, "{host}: {refused}");
        assert_names_the_token_setting(&refused);
    }
    for (method, path) in [
        (Method::POST, "/api/v1/dead-letters/replay?all=true"),
        (Method::DELETE, "/api/v1/dead-letters?all=true"),
        (Method::POST, "/api/v1/dead-letters/1/replay"),
        (Method::POST, "/api/v1/keys/demo/k/release"),
        (Method::POST, "/api/v1/keys/demo/k/complete"),
    ] {
        for request in [
            api.request(method.clone(), path),
            api.request(method.clone(), path)
                .header("authorization", "Bearer anything"),
        ] {
            let (status, refused) = answer_of(request).await;
            assert_eq!(status, 403, "{method} {path}: {refused}");
            assert_names_the_token_setting(&refused);
        }
    }
    server.stop().await;
    drop_database(db, &url).await;
}

/// The document is valid OpenAPI 3.1 by openapi-spec-validator, which `scripts/test`
/// installs; without it this test fails.
#[test]
fn the_openapi_document_validates() {
    let home = std::env::var("HOME").expect("HOME is set");
    let validator = format!("{home}/.cache/justonce/openapi-venv/bin/openapi-spec-validator");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    let output = std::process::Command::new(&validator)
        .arg(path)
        .output()
        .unwrap_or_else(|e| {
            panic!("{validator}: {e}: run scripts/test once, which installs openapi-spec-validator")
        });
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{printed}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(printed.contains("OK"), "{printed}");
}

/// A refusal that tells the operator to set `server.admin_token`.
fn assert_names_the_token_setting(refused: &serde_json::Value) {
    let detail = refused["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("server.admin_token"), "{refused}");
}
