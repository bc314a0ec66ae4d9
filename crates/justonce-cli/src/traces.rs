//! `serve`'s spans exported over OTLP/HTTP (protobuf), and the propagator that joins them to
//! the senders' and the targets' traces through W3C trace context.

use justonce_sql::trace::{self, TRACEPARENT, TRACESTATE, TraceContext, TracePropagator};
use opentelemetry::KeyValue;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use tracing::{Level, Metadata};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{FilterFn, Filtered};
use tracing_subscriber::{Layer, Registry};

/// The exporter of a running service: it sends the spans still batched when dropped.
pub struct Traces {
    provider: SdkTracerProvider,
}

impl Drop for Traces {
    fn drop(&mut self) {
        if let Err(error) = self.provider.shutdown() {
            tracing::warn!(%error, "the last spans could not be exported");
        }
    }
}

/// The layer that exports justonce's spans to `url`, in batches, and the handle that
/// flushes them at the end. Installs the propagator that makes a receipt continue its
/// sender's trace and a delivery continue its receipt's.
pub fn layer(url: &str) -> anyhow::Result<(ExportLayer, Traces)> {
    // The headers, timeout and compression come from the standard variables.
    let exporter = SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .with_protocol(Protocol::HttpBinary)
        .build()?;
    // The sampler comes from OTEL_TRACES_SAMPLER, parent-based always-on by default.
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource())
        .build();
    let tracer = provider.tracer("justonce");
    trace::set_propagator(OpenTelemetry);
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(FilterFn::new(exported as fn(&Metadata<'_>) -> bool));
    Ok((layer, Traces { provider }))
}

/// The layer [`layer`] makes.
pub type ExportLayer = Filtered<
    tracing_opentelemetry::OpenTelemetryLayer<Registry, opentelemetry_sdk::trace::Tracer>,
    FilterFn<fn(&Metadata<'_>) -> bool>,
    Registry,
>;

/// What is exported: justonce's own spans (a receipt, a run, a delivery), each with the
/// events at `info` and above that happen in it. The long-lived spans of the service, such
/// as a consumer's, would hold every message in one endless trace: they are left out.
fn exported(metadata: &Metadata<'_>) -> bool {
    if metadata.is_span() {
        metadata.name().starts_with("justonce.")
    } else {
        *metadata.level() <= Level::INFO
    }
}

/// The service's resource: `service.name` from OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES,
/// else `justonce`, and its version.
fn resource() -> Resource {
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|name| !name.trim().is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|attributes| {
            attributes
                .split(',')
                .any(|pair| pair.trim_start().starts_with("service.name="))
        });
    let builder = Resource::builder()
        .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")));
    if named {
        builder.build()
    } else {
        builder.with_service_name("justonce").build()
    }
}

/// W3C trace context to and from the spans that `tracing-opentelemetry` exports.
struct OpenTelemetry;

impl TracePropagator for OpenTelemetry {
    fn set_parent(&self, span: &tracing::Span, parent: &TraceContext) {
        let carrier: HashMap<String, String> = parent
            .headers()
            .map(|(name, value)| (name.to_owned(), value.to_owned()))
            .collect();
        let parent = TraceContextPropagator::new().extract(&carrier);
        // A span that is not exported has no parent to take: nothing to do.
        let _ = span.set_parent(parent);
    }

    fn context_of(&self, span: &tracing::Span) -> Option<TraceContext> {
        let context = span.context();
        if !context.span().span_context().is_valid() {
            return None;
        }
        let mut carrier = HashMap::new();
        TraceContextPropagator::new().inject_context(&context, &mut carrier);
        TraceContext::parse(
            carrier.get(TRACEPARENT)?,
            carrier.get(TRACESTATE).map(String::as_str),
        )
    }
}
