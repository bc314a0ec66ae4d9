//! Traces: `serve` exports the spans of a webhook's receipt and delivery over OTLP/HTTP to
//! a collector, in the sender's trace, and the target receives the delivery's context.

use crate::serve::{Server, await_keys, client, database, drop_database, signature};
use axum::Router;
use axum::body::Bytes;
use axum::routing::post;
use justonce_tests::{Sink, TestBackend};
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::sync::{Arc, Mutex};

on_every_database!(
    a_webhooks_receipt_and_delivery_are_one_trace_from_sender_to_target,
    a_broker_messages_claim_and_delivery_are_one_trace_from_sender_to_target,
);

/// An OTLP/HTTP collector on loopback: keeps every export request's spans, with the
/// resource's service name, and the content type each request came with.
#[derive(Clone, Default)]
struct Collector {
    exports: Arc<Mutex<Vec<(String, ExportTraceServiceRequest)>>>,
}

impl Collector {
    /// Starts it; returns it with its base URL, as `OTEL_EXPORTER_OTLP_ENDPOINT` takes it.
    async fn start() -> (Self, String) {
        let collector = Self::default();
        let exports = Arc::clone(&collector.exports);
        let app = Router::new().route(
            "/v1/traces",
            post(move |headers: axum::http::HeaderMap, body: Bytes| {
                let exports = Arc::clone(&exports);
                async move {
                    let content_type = headers
                        .get("content-type")
                        .and_then(|value| value.to_str().ok())
                        .unwrap_or_default()
                        .to_owned();
                    let request = ExportTraceServiceRequest::decode(body).expect("OTLP protobuf");
                    exports.lock().unwrap().push((content_type, request));
                    // An empty ExportTraceServiceResponse: everything accepted.
                    ([("content-type", "application/x-protobuf")], Vec::new())
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (collector, format!("http://{addr}"))
    }

    /// Every span received, with its service's name.
    fn spans(&self) -> Vec<(String, Span)> {
        let exports = self.exports.lock().unwrap();
        let mut spans = Vec::new();
        for (content_type, request) in exports.iter() {
            assert_eq!(content_type, "application/x-protobuf");
            for resource_spans in &request.resource_spans {
                let service = resource_spans
                    .resource
                    .iter()
                    .flat_map(|resource| &resource.attributes)
                    .find(|attribute| attribute.key == "service.name")
                    .and_then(|attribute| attribute.value.as_ref()?.value.as_ref())
                    .map(|value| match value {
                        Value::StringValue(name) => name.clone(),
                        other => format!("{other:?}"),
                    })
                    .unwrap_or_default();
                for scope_spans in &resource_spans.scope_spans {
                    for span in &scope_spans.spans {
                        spans.push((service.clone(), span.clone()));
                    }
                }
            }
        }
        spans
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// The one span named `name` in `trace_id` (hex).
fn one_span<'s>(spans: &'s [(String, Span)], trace_id: &str, name: &str) -> &'s Span {
    let found: Vec<&Span> = spans
        .iter()
        .map(|(_, span)| span)
        .filter(|span| span.name == name && hex(&span.trace_id) == trace_id)
        .collect();
    let names: Vec<(&str, String)> = spans
        .iter()
        .map(|(_, span)| (span.name.as_str(), hex(&span.trace_id)))
        .collect();
    assert_eq!(found.len(), 1, "{name} in {trace_id}: {names:?}");
    found[0]
}

/// Posts the event `id`, with `traceparent` if given, and expects it accepted.
async fn post_traced(public: &str, id: &str, traceparent: Option<&str>) {
    let body = format!(r#"{{"id":"{id}"}}"#);
    let mut request = client()
        .post(format!("{public}/webhooks/demo"))
        .header("content-type", "application/json")
        .header("x-signature", signature(&body))
        .body(body);
    if let Some(traceparent) = traceparent {
        request = request
            .header("traceparent", traceparent)
            .header("tracestate", "congo=t61rcWkgMzE");
    }
    let response = request.send().await.unwrap();
    assert_eq!(response.status(), 200);
    let answer = response.text().await.unwrap();
    assert!(answer.contains("accepted"), "{answer}");
}

async fn a_webhooks_receipt_and_delivery_are_one_trace_from_sender_to_target<DB: TestBackend>(
    test: &str,
) {
    let (db, url) = database::<DB>(test).await;
    let (collector, endpoint) = Collector::start().await;
    let sink = Sink::start().await;
    let mut server = Server::configure(&url, &sink.url());
    let logs = server
        .start_logged(
            &[],
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("RUST_LOG", "warn"),
            ],
        )
        .await;
    let (trace_id, sender_span) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    let sender = format!("00-{trace_id}-{sender_span}-01");
    post_traced(&server.public, "evt_traced", Some(&sender)).await;
    post_traced(&server.public, "evt_untraced", None).await;
    let by_key = await_keys(&sink, 2).await;
    assert_eq!(by_key.len(), 2, "{by_key:?}");
    let received = sink.received();
    let traceparent_of = |key: &str| {
        let request = received
            .iter()
            .find(|request| request.key.as_deref() == Some(key))
            .unwrap();
        let traceparent = request.headers["traceparent"].clone();
        let fields: Vec<String> = traceparent.split('-').map(str::to_owned).collect();
        assert_eq!(fields.len(), 4, "{traceparent}");
        (fields, request.headers.get("tracestate").cloned())
    };
    // The target joins the sender's trace, under a span of the service's own.
    let (traced, tracestate) = traceparent_of("demo:evt_traced");
    assert_eq!((traced[0].as_str(), traced[1].as_str()), ("00", trace_id));
    assert_ne!(traced[2], sender_span);
    assert_eq!(traced[3], "01", "the sender sampled it");
    assert_eq!(tracestate.as_deref(), Some("congo=t61rcWkgMzE"));
    let (untraced, _) = traceparent_of("demo:evt_untraced");
    assert_ne!(untraced[1], trace_id);

    // The batch still waiting is exported as the service stops.
    server.stop().await;
    let spans = collector.spans();
    assert!(
        spans.iter().all(|(service, _)| service == "justonce"),
        "{:?}",
        spans.iter().map(|(service, _)| service).collect::<Vec<_>>()
    );
    let receive = one_span(&spans, trace_id, "justonce.receive");
    let run = one_span(&spans, trace_id, "justonce.run");
    let deliver = one_span(&spans, trace_id, "justonce.deliver");
    assert_eq!(hex(&receive.parent_span_id), sender_span);
    assert_eq!(
        run.parent_span_id, receive.span_id,
        "the commit is in the receipt"
    );
    assert_eq!(
        deliver.parent_span_id, receive.span_id,
        "the delivery continues the receipt"
    );
    assert_eq!(hex(&deliver.span_id), traced[2], "the target's parent");
    // An event sent without a context starts a trace of its own at its receipt.
    let receive = one_span(&spans, &untraced[1], "justonce.receive");
    assert!(receive.parent_span_id.is_empty());
    let deliver = one_span(&spans, &untraced[1], "justonce.deliver");
    assert_eq!(deliver.parent_span_id, receive.span_id);
    assert_eq!(hex(&deliver.span_id), untraced[2]);

    let logs = logs.await.unwrap();
    assert!(logs.is_empty(), "{logs:#?}");
    drop_database(db, &url).await;
}

async fn a_broker_messages_claim_and_delivery_are_one_trace_from_sender_to_target<
    DB: TestBackend,
>(
    test: &str,
) {
    use redis::AsyncCommands;
    let (db, url) = database::<DB>(test).await;
    let (collector, endpoint) = Collector::start().await;
    let sink = Sink::start().await;
    let redis_url = justonce_tests::redis_url();
    let stream = format!("{}orders", db.prefix);
    let mut redis = redis::Client::open(redis_url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .expect("Redis");
    let (trace_id, sender_span) = ("0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331");
    let sender = format!("00-{trace_id}-{sender_span}-01");
    // Added before the service starts: its group begins at the start of the stream.
    let _: String = redis
        .xadd(
            &stream,
            "*",
            &[
                ("order_id", "order-1"),
                ("body", "{}"),
                ("traceparent", sender.as_str()),
            ],
        )
        .await
        .unwrap();
    let consumer = format!(
        "[consumers.orders]\nfrom = \"{redis_url}\"\nstream = \"{stream}\"\n\
         id = \"header:order_id\"\ntarget = \"{}\"\n",
        sink.url()
    );
    let mut server = Server::configure_with(&url, &sink.url(), &consumer);
    let logs = server
        .start_logged(
            &[],
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
                ("RUST_LOG", "warn"),
            ],
        )
        .await;
    assert_eq!(await_keys(&sink, 1).await.len(), 1);
    let received = sink.received();
    let traceparent = &received[0].headers["traceparent"];
    let fields: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(fields[..2], ["00", trace_id], "{traceparent}");
    assert_ne!(fields[2], sender_span);

    server.stop().await;
    let spans = collector.spans();
    let consume = one_span(&spans, trace_id, "justonce.consume");
    let run = one_span(&spans, trace_id, "justonce.run");
    let deliver = one_span(&spans, trace_id, "justonce.deliver");
    assert_eq!(hex(&consume.parent_span_id), sender_span);
    assert_eq!(
        run.parent_span_id, consume.span_id,
        "the commit is in the claim"
    );
    assert_eq!(
        deliver.parent_span_id, run.span_id,
        "the delivery continues the commit"
    );
    assert_eq!(hex(&deliver.span_id), fields[2], "the target's parent");
    let logs = logs.await.unwrap();
    assert!(logs.is_empty(), "{logs:#?}");
    let _: () = redis.del(&stream).await.unwrap();
    drop_database(db, &url).await;
}
