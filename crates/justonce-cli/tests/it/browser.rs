//! The admin listener in a real headless Chromium: a page on another origin cannot make
//! the browser change anything.

use crate::admin_api::{Api, TOKEN, post_event};
use crate::serve::{Server, database, drop_database};
use axum::response::Html;
use justonce_tests::Sink;
use justonce_tests::browser::{Browser, wait_until};
use serde_json::Value;

/// A server with `server.admin_token` set, delivering to `sink`.
async fn server_with_token(
    url: &str,
    sink: &Sink,
) -> (Server, tokio::task::JoinHandle<Vec<String>>) {
    let mut server =
        Server::configure_all(url, &sink.url(), "admin_token = \"env:ADMIN_TOKEN\"", "");
    let log = server
        .start_logged(&[], &[("ADMIN_TOKEN", TOKEN), ("RUST_LOG", "warn")])
        .await;
    (server, log)
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
    let (mut server, _log) = server_with_token(&url, &sink).await;
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
