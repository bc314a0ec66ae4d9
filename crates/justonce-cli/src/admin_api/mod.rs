//! The admin API: JSON under `/api/v1` on the admin listener, described by the OpenAPI 3.1
//! document served at `/openapi.json` and kept in the repository as `docs/openapi.json`.
//! [`access`] says who may use it; every failure is problem+json.

pub(crate) mod access;
mod consumers;
pub(crate) mod dashboard;
mod dead_letters;
mod deliveries;
pub(crate) mod events;
mod keys;
pub(crate) mod params;
pub(crate) mod problem;

pub use access::{Access, AdminToken};

use crate::probes::Consumers;
use axum::Router;
use axum::handler::Handler;
use axum::http::header::CONTENT_TYPE;
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodFilter, get, on};
use justonce_sql::{Backend, Inbox};
use std::sync::Arc;

/// The API's OpenAPI 3.1 document, as the repository keeps it.
pub const OPENAPI: &str = include_str!("../../../../docs/openapi.json");

/// What every route reads: the store, the sources and consumers configured, and what the
/// service knows of the consumers it runs.
pub struct Admin<DB: Backend> {
    inbox: Inbox<DB>,
    sources: Vec<String>,
    /// Every consumer configured, run by this process or not: their events are stored.
    consumer_names: Vec<String>,
    consumers: Arc<Consumers>,
}

type AdminState<DB> = Arc<Admin<DB>>;

/// The API's routes, and each one's method and path as it was added: the list the
/// document's test compares with the document.
struct Routes<DB: Backend> {
    router: Router<AdminState<DB>>,
    listed: Vec<(Method, &'static str)>,
}

impl<DB: Backend> Routes<DB> {
    /// Every route of the API.
    fn all() -> Self {
        let routes = Self {
            router: Router::new(),
            listed: Vec::new(),
        };
        routes
            .add(Method::GET, "/api/v1/stats", consumers::stats::<DB>)
            .add(Method::GET, "/api/v1/dashboard", dashboard::show::<DB>)
            .add(Method::GET, "/api/v1/consumers", consumers::list::<DB>)
            .add(Method::GET, "/api/v1/events", events::list::<DB>)
            .add(Method::GET, "/api/v1/events/{id}", events::show::<DB>)
            .add(
                Method::POST,
                "/api/v1/events/replay",
                events::replay_range::<DB>,
            )
            .add(
                Method::POST,
                "/api/v1/events/{id}/replay",
                events::replay::<DB>,
            )
            .add(Method::GET, "/api/v1/replays", events::replays::<DB>)
            .add(
                Method::GET,
                "/api/v1/deliveries/{id}",
                deliveries::show::<DB>,
            )
            .add(
                Method::GET,
                "/api/v1/dead-letters",
                dead_letters::list::<DB>,
            )
            .add(
                Method::DELETE,
                "/api/v1/dead-letters",
                dead_letters::purge::<DB>,
            )
            .add(
                Method::POST,
                "/api/v1/dead-letters/replay",
                dead_letters::replay_matching::<DB>,
            )
            .add(
                Method::POST,
                "/api/v1/dead-letters/{id}/replay",
                dead_letters::replay::<DB>,
            )
            .add(
                Method::GET,
                "/api/v1/keys/{consumer}/{key}",
                keys::show::<DB>,
            )
            .add(
                Method::POST,
                "/api/v1/keys/{consumer}/{key}/release",
                keys::release::<DB>,
            )
            .add(
                Method::POST,
                "/api/v1/keys/{consumer}/{key}/complete",
                keys::complete::<DB>,
            )
    }

    fn add<H, T>(mut self, method: Method, path: &'static str, handler: H) -> Self
    where
        H: Handler<T, AdminState<DB>>,
        T: 'static,
    {
        let filter = MethodFilter::try_from(method.clone()).expect("a method axum routes");
        self.router = self.router.route(path, on(filter, handler));
        self.listed.push((method, path));
        self
    }
}

/// The API behind its access check, and `/openapi.json`, for the admin listener. Paths and
/// methods it does not have are answered problem+json.
pub fn router<DB: Backend>(
    inbox: &Inbox<DB>,
    sources: &[String],
    consumer_names: &[String],
    consumers: &Arc<Consumers>,
    access: Arc<Access>,
) -> Router {
    let admin = Arc::new(Admin {
        inbox: inbox.clone(),
        sources: sources.to_vec(),
        consumer_names: consumer_names.to_vec(),
        consumers: Arc::clone(consumers),
    });
    Routes::<DB>::all()
        .router
        .with_state(admin)
        .layer(axum::middleware::from_fn_with_state(access, access::check))
        .route("/openapi.json", get(document))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
}

async fn document() -> Response {
    ([(CONTENT_TYPE, "application/json")], OPENAPI).into_response()
}

async fn not_found() -> Response {
    justonce_http::problem(
        StatusCode::NOT_FOUND,
        "not found",
        "no such path: /openapi.json lists the admin API's",
    )
}

async fn method_not_allowed() -> Response {
    justonce_http::problem(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed",
        "this path does not take this method: /openapi.json lists the admin API's",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Every route the router is built from is in the document, with its method, and the
    /// document has no route the router lacks.
    #[test]
    fn the_document_lists_exactly_the_routes_of_the_router() {
        let routed: BTreeSet<(String, String)> = Routes::<justonce_sql::sqlx::Sqlite>::all()
            .listed
            .into_iter()
            .map(|(method, path)| (method.as_str().to_lowercase(), path.to_owned()))
            .collect();
        let document: serde_json::Value = serde_json::from_str(OPENAPI).unwrap();
        let mut documented = BTreeSet::new();
        for (path, item) in document["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                if ["get", "post", "delete", "put", "patch", "head"].contains(&method.as_str()) {
                    documented.insert((method.clone(), path.clone()));
                }
            }
        }
        // The document itself is served beside the API, outside its access check.
        assert!(documented.remove(&("get".to_owned(), "/openapi.json".to_owned())));
        assert_eq!(routed, documented);
    }
}
