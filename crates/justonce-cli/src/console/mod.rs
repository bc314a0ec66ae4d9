//! The web console on the admin listener: HTML pages drawn on the server from the store,
//! each at a URL that can be shared, with a stylesheet and a small script of our own
//! embedded in the binary. Changes (replays) go through the admin API from the script,
//! with the token the operator typed, kept in the tab's `sessionStorage`.
//!
//! Pages follow the API's rule for reads. Without `server.admin_token`, a page is drawn
//! with its data. With it, a page asked for without the token is an empty frame (a
//! browser sends no header when it follows a link); the script then asks for the same URL
//! again with the token and shows what it answers. Data is never served without the token.

mod chart;
mod pages;
#[cfg(test)]
mod tests;

use crate::admin_api::AdminToken;
use crate::admin_api::access::{self, Access, bearer, unauthorized};
use crate::probes::Consumers;
use axum::Router;
use axum::http::HeaderMap;
use axum::http::header::{
    CACHE_CONTROL, CONTENT_SECURITY_POLICY, CONTENT_TYPE, VARY, X_CONTENT_TYPE_OPTIONS,
};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use justonce_sql::{Backend, Inbox};
use std::future::Future;
use std::sync::Arc;

const STYLESHEET: &str = include_str!("console.css");
const SCRIPT: &str = include_str!("console.js");

/// What every page reads.
struct Console<DB: Backend> {
    inbox: Inbox<DB>,
    consumers: Arc<Consumers>,
    token: Option<AdminToken>,
}

type ConsoleState<DB> = Arc<Console<DB>>;

/// The console's pages and assets, for the admin listener.
pub fn router<DB: Backend>(
    inbox: &Inbox<DB>,
    consumers: &Arc<Consumers>,
    access: &Arc<Access>,
) -> Router {
    let console = Arc::new(Console {
        inbox: inbox.clone(),
        consumers: Arc::clone(consumers),
        token: access.token().cloned(),
    });
    Router::new()
        .route("/", get(pages::dashboard::<DB>))
        .route("/events", get(pages::events::<DB>))
        .route("/events/{id}", get(pages::event::<DB>))
        .route("/dead-letters", get(pages::dead_letters::<DB>))
        .route("/consumers", get(pages::consumers::<DB>))
        .with_state(console)
        .layer(axum::middleware::from_fn_with_state(
            Arc::clone(access),
            access::own_host_only,
        ))
        .route(
            "/assets/console.css",
            get(|| async { asset("text/css; charset=utf-8", STYLESHEET) }),
        )
        .route(
            "/assets/console.js",
            get(|| async { asset("text/javascript; charset=utf-8", SCRIPT) }),
        )
}

/// An embedded asset. It changes only with the binary: browsers keep it for an hour.
fn asset(content_type: &'static str, text: &'static str) -> Response {
    (
        [
            (CONTENT_TYPE, content_type),
            (CACHE_CONTROL, "public, max-age=3600"),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        text,
    )
        .into_response()
}

/// The page `title` with the content `main` draws, when the request may read the store
/// (the API's rule); without the token that is set, the empty frame the script fills.
async fn page<DB: Backend>(
    console: &Console<DB>,
    headers: &HeaderMap,
    title: &str,
    main: impl Future<Output = Result<String, crate::admin_api::problem::ApiError>>,
) -> Response {
    let main = match (&console.token, bearer(headers)) {
        (None, _) => main.await,
        (Some(token), Some(given)) if token.matches(given) => main.await,
        (Some(_), Some(_)) => {
            return unauthorized("the bearer token is not server.admin_token");
        }
        (Some(_), None) => Ok(format!(
            "<main data-needs-token><h1>{}</h1><p>server.admin_token is set: type the \
             token in the form above to load this page. It is kept in this tab only.</p></main>",
            escape(title)
        )),
    };
    match main {
        Ok(main) => html(&layout(title, console.token.is_some(), &main)),
        Err(error) => error.into_response(),
    }
}

/// The frame of every page: the navigation, the token form and the status line.
fn layout(title: &str, token_set: bool, main: &str) -> String {
    let token_note = if token_set {
        ""
    } else {
        "<p class=\"note\">server.admin_token is not set: pages are read-only, and \
         replays need it.</p>"
    };
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\
         <title>{title} · justonce</title>\
         <link rel=\"stylesheet\" href=\"/assets/console.css\">\
         <script src=\"/assets/console.js\" defer></script></head><body>\
         <header><nav><strong>justonce</strong> <a href=\"/\">Dashboard</a> \
         <a href=\"/events\">Events</a> <a href=\"/dead-letters\">Dead letters</a> \
         <a href=\"/consumers\">Consumers</a></nav>\
         <form id=\"token-form\"><label for=\"admin-token\">Admin token</label> \
         <input id=\"admin-token\" type=\"password\" autocomplete=\"off\"> \
         <button type=\"submit\">Use token</button></form>{token_note}\
         <p id=\"status\" role=\"status\" aria-live=\"polite\"></p></header>{main}</body></html>",
        title = escape(title),
    )
}

/// A page: never cached, since it holds the store's state, and answered differently with
/// the token; no script, style or frame but its own.
fn html(page: &str) -> Response {
    (
        [
            (CONTENT_TYPE, "text/html; charset=utf-8"),
            (CACHE_CONTROL, "no-store"),
            (VARY, "authorization"),
            (X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (
                CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                 img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
            ),
        ],
        page.to_owned(),
    )
        .into_response()
}

/// `text` safe in HTML text and in quoted attribute values.
fn escape(text: &str) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => escaped.push_str("&amp;"),
            '<' => escaped.push_str("&lt;"),
            '>' => escaped.push_str("&gt;"),
            '"' => escaped.push_str("&quot;"),
            '\'' => escaped.push_str("&#39;"),
            c => escaped.push(c),
        }
    }
    escaped
}
