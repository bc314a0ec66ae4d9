//! W3C trace context that travels with the work, and the hook that ties justonce's spans to
//! a tracing system that exports them.
//!
//! An outbox row keeps the `traceparent` and `tracestate` it was written with, and its
//! delivery sends them on. Without a [`TracePropagator`], the stored context travels
//! unchanged. With one installed (the `justonce` binary installs one when it exports
//! traces over OTLP), the span of a receipt becomes a child of the sender's context, the
//! row stores the receipt's own context, and each delivery is a span under the stored
//! context whose own context goes to the destination: one trace from sender to target.
//!
//! A propagator for OpenTelemetry through `tracing-opentelemetry` is a few lines: extract
//! a context from the two headers with `TraceContextPropagator` and hand it to
//! `OpenTelemetrySpanExt::set_parent`; for [`TracePropagator::context_of`], inject
//! `OpenTelemetrySpanExt::context` and parse the result with [`TraceContext::parse`].

use std::sync::OnceLock;

/// The W3C trace context of one piece of work: a well-formed `traceparent`, and the
/// `tracestate` that goes with it.
///
/// ```
/// use justonce_core::TraceContext;
///
/// let context = TraceContext::parse(
///     "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
///     Some("congo=t61rcWkgMzE"),
/// )
/// .expect("a well-formed traceparent");
/// assert_eq!(context.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
/// assert_eq!(context.tracestate(), Some("congo=t61rcWkgMzE"));
///
/// // W3C: a malformed traceparent is ignored, and so is its tracestate.
/// assert!(TraceContext::parse("00-not-a-trace-01", Some("congo=t61rcWkgMzE")).is_none());
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    traceparent: String,
    tracestate: Option<String>,
}

/// The header that names the trace and the parent span.
pub const TRACEPARENT: &str = "traceparent";

/// The header of vendor-specific trace data.
pub const TRACESTATE: &str = "tracestate";

/// The longest `tracestate` kept, as the W3C recommends propagating.
const MAX_TRACESTATE: usize = 512;

impl TraceContext {
    /// The context of `traceparent` and `tracestate`, or `None` when `traceparent` is not
    /// well formed: the W3C says to ignore it then. A `tracestate` that is empty, over 512
    /// bytes or not visible ASCII is left out; the context keeps its `traceparent`.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        if !is_traceparent(traceparent) {
            return None;
        }
        let tracestate = tracestate.filter(|state| {
            !state.trim().is_empty()
                && state.len() <= MAX_TRACESTATE
                && state.bytes().all(|b| b.is_ascii_graphic() || b == b' ')
        });
        Some(Self {
            traceparent: traceparent.to_owned(),
            tracestate: tracestate.map(str::to_owned),
        })
    }

    /// The context among `headers`, named in any case, as [`TraceContext::parse`] reads it.
    pub fn from_headers<'h>(headers: impl IntoIterator<Item = (&'h str, &'h str)>) -> Option<Self> {
        let (mut traceparent, mut tracestate) = (None, None);
        for (name, value) in headers {
            if name.eq_ignore_ascii_case(TRACEPARENT) {
                traceparent = Some(value);
            } else if name.eq_ignore_ascii_case(TRACESTATE) {
                tracestate = Some(value);
            }
        }
        Self::parse(traceparent?, tracestate)
    }

    /// The `traceparent` header's value.
    pub fn traceparent(&self) -> &str {
        &self.traceparent
    }

    /// The `tracestate` header's value, if there is one worth keeping.
    pub fn tracestate(&self) -> Option<&str> {
        self.tracestate.as_deref()
    }

    /// The trace id: 32 lower-case hex digits.
    pub fn trace_id(&self) -> &str {
        &self.traceparent[3..35]
    }

    /// The id of the span the context names as the parent: 16 lower-case hex digits.
    pub fn parent_id(&self) -> &str {
        &self.traceparent[36..52]
    }

    /// The context as header pairs: `traceparent`, then `tracestate` if there is one.
    pub fn headers(&self) -> impl Iterator<Item = (&'static str, &str)> {
        std::iter::once((TRACEPARENT, self.traceparent.as_str()))
            .chain(self.tracestate.as_deref().map(|state| (TRACESTATE, state)))
    }
}

/// Whether `value` is a `traceparent` of version 00 (`00-<32 hex>-<16 hex>-<2 hex>`), or of
/// a later version that starts the same way, with neither id all zeros.
fn is_traceparent(value: &str) -> bool {
    let Some(start) = value.get(..55) else {
        return false;
    };
    let fields: Vec<&str> = start.split('-').collect();
    let hex = |field: &str, len| {
        field.len() == len
            && field
                .bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let [version, trace_id, parent_id, flags] = fields[..] else {
        return false;
    };
    let zero = |field: &str| field.bytes().all(|b| b == b'0');
    let rest_ok = match &value[55..] {
        "" => true,
        rest => version != "00" && rest.starts_with('-'),
    };
    hex(version, 2)
        && version != "ff"
        && hex(trace_id, 32)
        && !zero(trace_id)
        && hex(parent_id, 16)
        && !zero(parent_id)
        && hex(flags, 2)
        && rest_ok
}

/// Ties justonce's spans to a tracing system that exports them, such as OpenTelemetry.
/// Installed once per process with [`set_propagator`].
pub trait TracePropagator: Send + Sync + 'static {
    /// Makes `span`, just created and not yet entered, a child of `parent`.
    fn set_parent(&self, span: &tracing::Span, parent: &TraceContext);

    /// `span`'s own context, to store or send on; `None` when the span is not exported.
    fn context_of(&self, span: &tracing::Span) -> Option<TraceContext>;
}

static PROPAGATOR: OnceLock<Box<dyn TracePropagator>> = OnceLock::new();

/// Installs `propagator` for the whole process, as a tracing subscriber is. Returns
/// `false`, and installs nothing, if one was installed already.
pub fn set_propagator(propagator: impl TracePropagator) -> bool {
    PROPAGATOR.set(Box::new(propagator)).is_ok()
}

/// Makes `span` a child of `parent` through the installed propagator; nothing without one.
pub fn set_parent(span: &tracing::Span, parent: &TraceContext) {
    if let Some(propagator) = PROPAGATOR.get() {
        propagator.set_parent(span, parent);
    }
}

/// The context to hand on from work done in `span`: the span's own when a propagator
/// exports it, else `inherited` unchanged.
pub fn context_to_send(
    span: &tracing::Span,
    inherited: Option<TraceContext>,
) -> Option<TraceContext> {
    PROPAGATOR
        .get()
        .and_then(|propagator| propagator.context_of(span))
        .or(inherited)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_checked_field_by_field() {
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert!(is_traceparent(valid));
        assert!(is_traceparent(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-later"
        ));
        for invalid in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-more",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0é",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7é-01",
        ] {
            assert!(!is_traceparent(invalid), "{invalid:?}");
        }
    }

    #[test]
    fn headers_are_read_in_any_case_and_a_bad_tracestate_is_left_out() {
        let parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let context =
            TraceContext::from_headers([("TraceParent", parent), ("TRACESTATE", "a=1")]).unwrap();
        assert_eq!(context.parent_id(), "00f067aa0ba902b7");
        let pairs: Vec<_> = context.headers().collect();
        assert_eq!(pairs, [(TRACEPARENT, parent), (TRACESTATE, "a=1")]);
        let long = "a=".to_owned() + &"b".repeat(MAX_TRACESTATE);
        for state in ["", "a=\u{7f}", "a=é", long.as_str()] {
            let context = TraceContext::parse(parent, Some(state)).unwrap();
            assert_eq!(context.tracestate(), None, "{state:?}");
        }
        assert!(TraceContext::from_headers([("tracestate", "a=1")]).is_none());
    }
}
