//! What an operator's tracing sees: each run, lease and Idempotency-Key request is a span
//! that names its scope, consumer and key.

use super::{on_every_database, respond};
use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use justonce_http::server::IdempotencyLayer;
use justonce_sql::{Fingerprint, Key, Leases, Scope};
use justonce_tests::{TestBackend, TestDb};
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

on_every_database!(runs_leases_and_requests_are_spans_with_scope_consumer_and_key);

type Fields = BTreeMap<String, String>;

/// Every span opened, by name, with its fields as recorded so far.
#[derive(Clone, Default)]
struct Spans(Arc<Mutex<HashMap<u64, (&'static str, Fields)>>>);

impl Spans {
    /// The fields of each span named `name`.
    fn named(&self, name: &str) -> Vec<Fields> {
        let spans = self.0.lock().unwrap();
        let found = spans.values().filter(|(span, _)| *span == name);
        found.map(|(_, fields)| fields.clone()).collect()
    }
}

struct Collect<'f>(&'f mut Fields);

impl Visit for Collect<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Spans {
    fn on_new_span(&self, attributes: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut fields = Fields::new();
        attributes.record(&mut Collect(&mut fields));
        let name = attributes.metadata().name();
        self.0.lock().unwrap().insert(id.into_u64(), (name, fields));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some((_, fields)) = self.0.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Collect(fields));
        }
    }
}

fn expected(scope: &str, consumer: &str, key: &str) -> Fields {
    [("scope", scope), ("consumer", consumer), ("key", key)]
        .into_iter()
        .map(|(name, value)| (name.to_owned(), value.to_owned()))
        .collect()
}

/// The span's scope, consumer and key, without its other fields.
fn identity_of(fields: &Fields) -> Fields {
    let named = ["scope", "consumer", "key"];
    let identity = fields
        .iter()
        .filter(|(name, _)| named.contains(&name.as_str()));
    identity
        .map(|(name, value)| (name.clone(), value.clone()))
        .collect()
}

async fn runs_leases_and_requests_are_spans_with_scope_consumer_and_key<DB: TestBackend>(
    test: &str,
) {
    let db = TestDb::<DB>::new(test).await;
    let spans = Spans::default();
    let _default =
        tracing::subscriber::set_default(tracing_subscriber::registry().with(spans.clone()));

    let tenant = db.inbox.with_scope(Scope::new("acme").unwrap());
    let key = Key::new("order:7").unwrap();
    let outcome = tenant
        .run(&key, b"x", |_tx| {
            Box::pin(async { Ok::<_, sqlx::Error>(()) })
        })
        .await
        .unwrap();
    assert!(matches!(outcome, justonce_sql::Outcome::Processed(())));
    let runs: Vec<Fields> = spans
        .named("justonce.run")
        .iter()
        .map(identity_of)
        .collect();
    assert_eq!(runs, vec![expected("acme", "test", "order:7")]);

    let identity = db.inbox.identity(&Key::new("charge:1").unwrap());
    let claim = db
        .inbox
        .claim_lease(&identity, &Fingerprint::of(b"x"), Duration::from_secs(5))
        .await
        .unwrap();
    assert!(matches!(claim, justonce_sql::LeaseClaim::Acquired(_)));
    let leases: Vec<Fields> = spans
        .named("justonce.lease")
        .iter()
        .map(identity_of)
        .collect();
    assert_eq!(leases, vec![expected("", "test", "charge:1")]);

    let app = Router::new()
        .route("/payments", post(|| async { StatusCode::CREATED }))
        .route_layer(IdempotencyLayer::new(db.inbox.clone()).shared());
    let request = Request::post("/payments")
        .header("idempotency-key", "pay-1")
        .body(Body::from("{}"))
        .unwrap();
    assert_eq!(respond(&app, request).await.0, StatusCode::CREATED);
    let requests: Vec<Fields> = spans
        .named("justonce.idempotency")
        .iter()
        .map(identity_of)
        .collect();
    assert_eq!(requests, vec![expected("", "POST /payments", "pay-1")]);
    db.cleanup().await;
}
