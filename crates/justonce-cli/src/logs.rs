//! The log subscriber: human text by default, or one JSON object a line for log
//! collectors, with the fields of the spans the event happened in (`key`, `source`,
//! `consumer`, `destination`) beside its own.

pub use crate::config::LogFormat;
use serde_json::{Map, Value};
use std::fmt;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;
use tracing_subscriber::fmt::format::{JsonFields, Writer};
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

impl clap::ValueEnum for LogFormat {
    fn value_variants<'a>() -> &'a [Self] {
        &[LogFormat::Text, LogFormat::Json]
    }

    fn to_possible_value(&self) -> Option<clap::builder::PossibleValue> {
        Some(clap::builder::PossibleValue::new(self.name()))
    }
}

/// Installs the subscriber: `RUST_LOG` filters, `default_filter` without it. With a
/// `traces_url`, spans are exported there too; the handle returned flushes them when
/// dropped. Should the exporter fail to start, the logs are installed all the same and the
/// error returned.
pub fn init(
    format: LogFormat,
    default_filter: &str,
    traces_url: Option<&str>,
) -> anyhow::Result<Flush> {
    let mut filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    // lapin logs a failed AMQP connection at every retry, where the consumer logs it once
    // per change: it stays quiet unless `RUST_LOG` names it.
    if !std::env::var("RUST_LOG").is_ok_and(|filter| filter.contains("lapin")) {
        filter = filter.add_directive("lapin=off".parse().expect("a valid directive"));
    }
    #[cfg(feature = "otlp")]
    let (export, flush) = match traces_url.map(crate::traces::layer).transpose() {
        Ok(Some((layer, traces))) => (
            Some(layer),
            Ok(Flush {
                _traces: Some(traces),
            }),
        ),
        Ok(None) => (None, Ok(Flush { _traces: None })),
        Err(error) => (None, Err(error.context("starting the traces exporter"))),
    };
    #[cfg(not(feature = "otlp"))]
    let (export, flush) = {
        debug_assert!(traces_url.is_none(), "the configuration refuses it");
        (None::<tracing_subscriber::layer::Identity>, Ok(Flush))
    };
    let registry = tracing_subscriber::registry().with(export);
    let logs = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    match format {
        LogFormat::Text => registry
            .with(
                logs.with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                    .with_filter(filter),
            )
            .init(),
        // Span fields are kept as JSON objects, so that each line can merge them.
        LogFormat::Json => registry
            .with(
                logs.fmt_fields(JsonFields::new())
                    .event_format(JsonLines)
                    .with_filter(filter),
            )
            .init(),
    }
    flush
}

/// Flushes the spans still waiting for export when dropped.
#[cfg(feature = "otlp")]
pub struct Flush {
    _traces: Option<crate::traces::Traces>,
}

/// Nothing to flush: this build exports no traces.
#[cfg(not(feature = "otlp"))]
pub struct Flush;

/// Writes each event as one flat JSON object. The innermost span's field wins over an
/// outer one's, and the event's own fields over both.
struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let mut line = Map::new();
        let mut time = String::new();
        SystemTime.format_time(&mut Writer::new(&mut time))?;
        line.insert("time".into(), time.into());
        let metadata = event.metadata();
        line.insert("level".into(), metadata.level().as_str().into());
        line.insert("target".into(), metadata.target().into());
        for span in ctx
            .event_scope()
            .into_iter()
            .flat_map(|scope| scope.from_root())
        {
            let extensions = span.extensions();
            let Some(fields) = extensions.get::<FormattedFields<N>>() else {
                continue;
            };
            if let Ok(Value::Object(fields)) = serde_json::from_str::<Value>(&fields.fields) {
                line.extend(fields);
            }
        }
        event.record(&mut Fields(&mut line));
        let text = serde_json::to_string(&line).map_err(|_| fmt::Error)?;
        writeln!(writer, "{text}")
    }
}

/// Collects an event's fields into a JSON object.
struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    /// A writer into a shared buffer.
    #[derive(Clone, Default)]
    struct Buffer(Arc<Mutex<Vec<u8>>>);

    impl std::io::Write for Buffer {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }

        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_json_line_holds_the_fields_of_its_spans_and_its_own() {
        let buffer = Buffer::default();
        let writer = buffer.clone();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(move || writer.clone())
            .fmt_fields(JsonFields::new())
            .event_format(JsonLines)
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let outer = tracing::info_span!("consumer", consumer = "orders", key = "outer");
            let _outer = outer.enter();
            let inner = tracing::info_span!("deliver", key = "orders:1", destination = "crm");
            let _inner = inner.enter();
            tracing::warn!(attempt = 3, destination = "crm-eu", "delivery failing");
        });
        let text = String::from_utf8(buffer.0.lock().unwrap().clone()).unwrap();
        assert_eq!(text.lines().count(), 1, "{text}");
        let line: Value = serde_json::from_str(&text).unwrap();
        assert!(line["time"].as_str().unwrap().ends_with('Z'), "{line}");
        assert_eq!(line["level"], "WARN");
        assert_eq!(line["target"], module_path!());
        assert_eq!(line["message"], "delivery failing");
        assert_eq!(line["consumer"], "orders");
        // The inner span's field over the outer's, the event's over both.
        assert_eq!(line["key"], "orders:1");
        assert_eq!(line["destination"], "crm-eu");
        assert_eq!(line["attempt"], 3);
    }
}
