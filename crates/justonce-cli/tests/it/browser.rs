//! The console in a real headless Chromium, as the operator uses it: the dashboard, an
//! event found and replayed, dead letters replayed; and a page on another origin cannot
//! make the browser change anything. These tests take the screenshots docs/console.md
//! shows: into the folder `JUSTONCE_SCREENSHOTS` names, else beside the build, so that a
//! test run leaves the checkout as it was.

use crate::admin_api::{Api, TOKEN, post_event, requests_with, server_with_token};
use crate::serve::{CLOSED_PORT, Server, amqp_url, database, delete_queue, drop_database};
use axum::response::Html;
use justonce_tests::browser::{Browser, wait_until};
use justonce_tests::{Answer, Sink, TestBackend};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

mod sqlite {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_console_finds_an_event_by_key_and_replays_it() {
        super::the_console_finds_an_event_by_key_and_replays_it::<justonce_sql::sqlx::Sqlite>(
            "browser_event_sqlite",
        )
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_letters_are_replayed_from_their_page() {
        super::dead_letters_are_replayed_from_their_page::<justonce_sql::sqlx::Sqlite>(
            "browser_dead_sqlite",
        )
        .await
    }
}

mod postgres {
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_console_finds_an_event_by_key_and_replays_it() {
        super::the_console_finds_an_event_by_key_and_replays_it::<justonce_sql::sqlx::Postgres>(
            "browser_event_postgres",
        )
        .await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn dead_letters_are_replayed_from_their_page() {
        super::dead_letters_are_replayed_from_their_page::<justonce_sql::sqlx::Postgres>(
            "browser_dead_postgres",
        )
        .await
    }
}

/// Posts the event `id` of the demo source and waits until the store has it delivered;
/// returns its event id.
async fn delivered_event(server: &Server, api: &Api, id: &str) -> i64 {
    post_event(server, "demo", &order_body(id)).await;
    let key = format!("demo:{id}");
    wait_until(&format!("{key} delivered"), || async {
        let listed = api.get("/api/v1/events?source=demo&state=delivered").await;
        let events = listed["events"].as_array().cloned().unwrap_or_default();
        events
            .iter()
            .find(|event| event["key"] == key.as_str())
            .and_then(|event| event["id"].as_i64())
            .ok_or_else(|| listed.to_string())
    })
    .await
}

/// The body of the order `id`, as the demo source receives it.
fn order_body(id: &str) -> String {
    format!(r#"{{"id":"{id}","total":"42.00"}}"#)
}

/// Serves `page` at `/` on a free loopback port: an origin other than the admin
/// listener's. Returns its address.
async fn serve_elsewhere(page: String) -> String {
    let app = axum::Router::new().route("/", axum::routing::get(move || async move { Html(page) }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    address
}

/// A page on another origin asks the admin API to replay a delivered event by script,
/// without a token and with a guessed one, then by a plain form: the page sees each
/// refused, and neither the store nor the target sees a replay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_on_another_origin_cannot_replay_an_event() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("browser_other_origin").await;
    let sink = Sink::start().await;
    let (mut server, _log) = server_with_token(&url, &sink, "").await;
    let api = Api::of(&server);
    let id = delivered_event(&server, &api, "order_1042").await;
    let stored = api.get(&format!("/api/v1/events/{id}")).await;
    let replay = format!("{}/api/v1/events/{id}/replay", server.admin);
    let page = format!(
        r#"<!doctype html>
<title>elsewhere</title>
<form id="form" method="post" action="{replay}"><button>replay</button></form>
<pre id="seen"></pre>
<script>
async function attempt(name, init) {{
  try {{
    const answer = await fetch("{replay}", init);
    return name + ": answered " + answer.status;
  }} catch (refused) {{
    return name + ": refused, " + refused.name;
  }}
}}
(async () => {{
  const seen = [
    await attempt("without a token", {{ method: "POST" }}),
    await attempt("with a guessed token", {{
      method: "POST",
      headers: {{ authorization: "Bearer guessed" }},
    }}),
  ];
  document.getElementById("seen").textContent = seen.join("\n");
}})();
</script>
"#
    );
    let elsewhere = serve_elsewhere(page).await;

    let browser = Browser::start().await;
    browser.goto(&elsewhere).await;
    let seen = wait_until("both scripted replays to settle", || async {
        let seen = browser.text("#seen").await?;
        if seen.lines().count() == 2 {
            Ok(seen)
        } else {
            Err(seen)
        }
    })
    .await;
    assert_eq!(
        seen,
        "without a token: refused, TypeError\nwith a guessed token: refused, TypeError"
    );
    browser.click("#form button").await;
    let refusal = wait_until("the form's answer", || async {
        let shown = browser.text("body").await?;
        if browser.url().await == replay && shown.contains("status") {
            Ok(shown)
        } else {
            Err(shown)
        }
    })
    .await;
    let refusal: Value =
        serde_json::from_str(&refusal).unwrap_or_else(|e| panic!("{e}: {refusal}"));
    assert_eq!(
        (&refusal["status"], &refusal["title"]),
        (
            &Value::from(403),
            &Value::from("cross-origin change refused")
        )
    );

    assert_eq!(
        api.get(&format!("/api/v1/events/{id}")).await,
        stored,
        "the store is unchanged"
    );
    assert_eq!(sink.requests(), 1, "the target received the event once");
    drop(browser);
    server.stop().await;
    drop_database(db, &url).await;
}

/// The consumers page: a consumer whose RabbitMQ answers shows `connected`; one whose
/// broker is down shows that it is not, and why.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_consumers_page_shows_each_consumers_connection() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("browser_consumers").await;
    let sink = Sink::start().await;
    let queue = format!("{}orders", db.prefix);
    let consumers = format!(
        r#"
[consumers.orders]
from = "{amqp}"
queue = "{queue}"
target = "{sink}"

[consumers.ledger]
from = "amqp://guest:guest@127.0.0.1:{closed}/%2f"
queue = "ledger"
target = "{sink}"
"#,
        amqp = amqp_url(),
        sink = sink.url(),
        closed = CLOSED_PORT,
    );
    let (mut server, _log) = server_with_token(&url, &sink, &consumers).await;

    let browser = Browser::start().await;
    open_with_token(&browser, &server, "/consumers").await;
    let (orders, ledger) = wait_until("orders connected, ledger refused", || async {
        browser.goto(&format!("{}/consumers", server.admin)).await;
        let row = |name: &str| format!("tr[data-consumer=\"{name}\"] td:nth-child(2)");
        let orders = browser.text(&row("orders")).await?;
        let ledger = browser.text(&row("ledger")).await?;
        if orders == "connected" && ledger.starts_with("not connected: ") {
            Ok((orders, ledger))
        } else {
            Err(format!("orders: {orders}; ledger: {ledger}"))
        }
    })
    .await;
    assert_eq!(orders, "connected");
    assert!(
        ledger.len() > "not connected: ".len(),
        "the error is shown: {ledger}"
    );
    assert_eq!(browser.count("tr[data-consumer]").await, 2);
    browser.screenshot(&screenshot_path("consumers.png")).await;
    drop(browser);
    server.stop().await;
    let broker = lapin::Connection::connect(&amqp_url(), lapin::ConnectionProperties::default())
        .await
        .expect("RabbitMQ");
    let channel = broker.create_channel().await.unwrap();
    delete_queue(&channel, &queue).await;
    drop_database(db, &url).await;
}

/// Without `server.admin_token`, the console reads as the API does: the dashboard, a search
/// and an event's page load with no token typed. Its replay button is refused by the API,
/// and the page shows the refusal's words; the target receives nothing more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_token_the_console_reads_and_shows_why_a_replay_is_refused() {
    let (db, url) = database::<justonce_sql::sqlx::Sqlite>("browser_no_token").await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&url, &sink.url());
    let _log = server.start_logged(&[], &[("RUST_LOG", "warn")]).await;
    let api = Api::of(&server);
    let id = delivered_event(&server, &api, "order_1042").await;

    let browser = Browser::start().await;
    browser.goto(&format!("{}/?since=1h", server.admin)).await;
    await_text(&browser, "[data-figure=\"accepted\"]", "1").await;
    browser
        .goto(&format!("{}/events?key=1042&match=contains", server.admin))
        .await;
    await_count(
        &browser,
        &format!("table#events tr[data-event-id=\"{id}\"]"),
        1,
    )
    .await;
    browser.goto(&format!("{}/events/{id}", server.admin)).await;
    await_count(&browser, "table#attempts tr.attempt", 1).await;
    let shown_body = browser.text("pre#event-body").await.unwrap();
    assert!(shown_body.contains("order_1042"), "{shown_body}");

    browser.click("#replay").await;
    let status = wait_until("the refusal shown", || async {
        let status = browser.text("#status").await?;
        if status.is_empty() {
            Err(status)
        } else {
            Ok(status)
        }
    })
    .await;
    let (code, refusal) = answer_of_replay(&server, id).await;
    assert_eq!(code, 403);
    assert_eq!(
        status,
        format!(
            "{}: {}",
            refusal["title"].as_str().unwrap(),
            refusal["detail"].as_str().unwrap()
        ),
        "the page shows the API's refusal"
    );
    assert!(status.contains("server.admin_token"), "{status}");
    browser.screenshot(&screenshot_path("no-token.png")).await;
    let shown = api.get(&format!("/api/v1/events/{id}")).await;
    assert_eq!(shown["state"], "delivered");
    assert_eq!(sink.requests(), 1, "the target received the event once");
    drop(browser);
    server.stop().await;
    drop_database(db, &url).await;
}

/// The API's answer to a replay of event `id` sent without a token, as a script on the
/// console's own origin sends it.
async fn answer_of_replay(server: &Server, id: i64) -> (u16, Value) {
    let answer = crate::serve::client()
        .post(format!("{}/api/v1/events/{id}/replay", server.admin))
        .send()
        .await
        .unwrap();
    let code = answer.status().as_u16();
    (
        code,
        serde_json::from_slice(&answer.bytes().await.unwrap()).unwrap(),
    )
}

/// Where a screenshot of the console is written: `JUSTONCE_SCREENSHOTS` (such as the
/// checkout's docs/screenshots, to refresh docs/console.md's), else the build's own folder.
fn screenshot_path(name: &str) -> PathBuf {
    let folder = std::env::var_os("JUSTONCE_SCREENSHOTS").map_or_else(
        || Path::new(env!("CARGO_TARGET_TMPDIR")).join("screenshots"),
        PathBuf::from,
    );
    std::fs::create_dir_all(&folder).unwrap();
    folder.join(name)
}

/// Opens `path` of the admin listener and types the token into the header's form, as the
/// operator does once per tab.
async fn open_with_token(browser: &Browser, server: &Server, path: &str) {
    browser.goto(&format!("{}{path}", server.admin)).await;
    browser
        .type_into("#admin-token", &format!("{TOKEN}{ENTER}"))
        .await;
}

/// The Enter key, as WebDriver types it.
const ENTER: char = '\u{E007}';

/// The text of `css` once it equals `expected`; fails with the text seen last.
async fn await_text(browser: &Browser, css: &str, expected: &str) {
    wait_until(&format!("{css} to read {expected:?}"), || async {
        let shown = browser.text(css).await?;
        if shown.trim() == expected {
            Ok(())
        } else {
            Err(shown)
        }
    })
    .await;
}

/// Waits until `css` matches `expected` elements.
async fn await_count(browser: &Browser, css: &str, expected: usize) {
    wait_until(&format!("{expected} of {css}"), || async {
        let count = browser.count(css).await;
        if count == expected {
            Ok(())
        } else {
            Err(format!("{count} on {}", browser.url().await))
        }
    })
    .await;
}

/// The operator's search: the dashboard shows the store's figures, a search by part of
/// the key finds the event, its page shows the body and the attempt, and Replay delivers it
/// again with the same key, the new attempt appearing on the page.
async fn the_console_finds_an_event_by_key_and_replays_it<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    let sink = Sink::start().await;
    let (mut server, _log) = server_with_token(&url, &sink, "").await;
    let api = Api::of(&server);
    let mut ids = Vec::new();
    for order in ["order_1041", "order_1042", "order_1043"] {
        ids.push(delivered_event(&server, &api, order).await);
    }
    let id = ids[1];
    post_event(&server, "demo", &order_body("order_1042")).await;

    wait_until("the duplicate counted in the store", || async {
        let dashboard = api.get("/api/v1/dashboard?since=1h").await;
        let totals = &dashboard["totals"];
        if totals["duplicates"] == 1 && totals["sent"] == 3 {
            Ok(())
        } else {
            Err(dashboard.to_string())
        }
    })
    .await;

    let browser = Browser::start().await;
    open_with_token(&browser, &server, "/?since=1h").await;
    for (figure, expected) in [
        ("accepted", "3"),
        ("duplicates", "1"),
        ("sent", "3"),
        ("failed", "0"),
        ("backlog", "0"),
        ("oldest-due", ""),
    ] {
        await_text(&browser, &format!("[data-figure=\"{figure}\"]"), expected).await;
    }
    browser.screenshot(&screenshot_path("dashboard.png")).await;

    browser.goto(&format!("{}/events", server.admin)).await;
    await_count(&browser, "#event-search", 1).await;
    browser
        .type_into(
            "#event-search input[name=\"key\"]",
            &format!("demo:order_1042{ENTER}"),
        )
        .await;
    await_count(&browser, "table#events tr[data-event-id]", 1).await;
    let search = browser.url().await;
    assert!(
        search.contains("match=prefix&key=demo%3Aorder_1042"),
        "a search has an address to share, its key's start by default: {search}"
    );
    // Any part of the key, within the last day, which the page says.
    browser.goto(&format!("{}/events", server.admin)).await;
    await_count(&browser, "#event-search", 1).await;
    browser
        .click("#event-search select[name=\"match\"] option[value=\"contains\"]")
        .await;
    browser
        .type_into("#event-search input[name=\"key\"]", &format!("1042{ENTER}"))
        .await;
    await_count(&browser, "#searched-since", 1).await;
    assert_eq!(browser.count("table#events tr[data-event-id]").await, 1);
    let search = browser.url().await;
    assert!(search.contains("match=contains&key=1042"), "{search}");
    browser.goto(&search).await;
    await_count(
        &browser,
        &format!("table#events tr[data-event-id=\"{id}\"]"),
        1,
    )
    .await;
    browser
        .click(&format!(
            "table#events tr[data-event-id=\"{id}\"] a[href=\"/events/{id}\"]"
        ))
        .await;
    await_count(&browser, "table#attempts tr.attempt", 1).await;
    assert_eq!(browser.url().await, format!("{}/events/{id}", server.admin));
    let shown_body = browser.text("pre#event-body").await.unwrap();
    assert!(shown_body.contains("order_1042"), "{shown_body}");
    browser.screenshot(&screenshot_path("event.png")).await;

    browser.click("#replay").await;
    wait_until("the replay's status", || async {
        let status = browser.text("#status").await?;
        if status.contains("replayed") {
            Ok(())
        } else {
            Err(status)
        }
    })
    .await;
    await_count(&browser, "table#attempts tr.attempt", 2).await;
    let bodies = requests_with(&sink, "demo:order_1042");
    assert_eq!(
        bodies,
        [
            order_body("order_1042").into_bytes(),
            order_body("order_1042").into_bytes()
        ],
        "the target received the event twice with its one key"
    );
    drop(browser);
    server.stop().await;
    drop_database(db, &url).await;
}

/// Dead letters, newest first: one replayed by its row's button, then the others by
/// "replay all that match" after the confirmation; each reaches the target again and
/// leaves the page.
async fn dead_letters_are_replayed_from_their_page<DB: TestBackend>(test: &str) {
    let (db, url) = database::<DB>(test).await;
    // Each key's first delivery is refused, so that it is dead-lettered at once.
    let sink = Sink::scripted(Arc::new(|_, attempt| {
        Answer::status(if attempt == 1 { 400 } else { 200 })
    }))
    .await;
    let (mut server, _log) = server_with_token(&url, &sink, "").await;
    let api = Api::of(&server);
    let orders = ["order_2001", "order_2002", "order_2003"];
    for order in orders {
        post_event(&server, "demo", &order_body(order)).await;
    }
    let dead = wait_until("three dead letters", || async {
        let listed = api.get("/api/v1/dead-letters").await;
        let items = listed["items"].as_array().cloned().unwrap_or_default();
        if items.len() == 3 {
            Ok(items)
        } else {
            Err(listed.to_string())
        }
    })
    .await;
    let newest = dead.iter().max_by_key(|item| item["id"].as_i64()).unwrap();
    let (newest_id, newest_key) = (
        newest["id"].as_i64().unwrap(),
        newest["key"].as_str().unwrap(),
    );

    let browser = Browser::start().await;
    open_with_token(&browser, &server, "/dead-letters").await;
    let rows = "tr[data-dead-letter-id]";
    await_count(&browser, rows, 3).await;
    assert_eq!(
        browser
            .attribute(rows, "data-dead-letter-id")
            .await
            .unwrap(),
        Some(newest_id.to_string()),
        "the newest first"
    );
    browser
        .screenshot(&screenshot_path("dead-letters.png"))
        .await;

    browser
        .click(&format!(
            "tr[data-dead-letter-id=\"{newest_id}\"] button.replay"
        ))
        .await;
    wait_until("the replayed dead letter delivered", || async {
        let shown = api.get(&format!("/api/v1/deliveries/{newest_id}")).await;
        let received = requests_with(&sink, newest_key).len();
        if shown["state"] == "sent" && received == 2 {
            Ok(())
        } else {
            Err(format!("{received} received; {shown}"))
        }
    })
    .await;
    await_count(&browser, rows, 2).await;

    browser.click("#replay-matching").await;
    let question = wait_until("the confirmation", || browser.dialog_text()).await;
    assert!(!question.is_empty(), "the confirmation asks something");
    browser.accept_dialog().await;
    for order in orders {
        let key = format!("demo:{order}");
        wait_until(&format!("{key} delivered again"), || async {
            let received = requests_with(&sink, &key).len();
            if received == 2 {
                Ok(())
            } else {
                Err(format!("{received} received"))
            }
        })
        .await;
    }
    await_count(&browser, rows, 0).await;
    assert_eq!(
        api.get("/api/v1/dead-letters").await["items"],
        serde_json::json!([])
    );
    browser
        .goto(&format!("{}/events/{newest_id}", server.admin))
        .await;
    await_count(&browser, "table#attempts tr.attempt", 2).await;
    drop(browser);
    server.stop().await;
    drop_database(db, &url).await;
}
