//! The HTTP target a source or consumer delivers to.

use super::secret::resolve_secret;
use super::units::duration_text;
use crate::config::read::{Env, Origin, quoted};
use anyhow::{Context, Result, bail};
use justonce_cli_support::parse_duration;
use justonce_http::HttpDestination;
use std::time::Duration;

/// How long a delivery waits for its target's answer unless the target says otherwise.
const DEFAULT_TARGET_TIMEOUT: Duration = Duration::from_secs(10);

/// The target settings of a source or consumer, as written.
pub struct Target<'a> {
    pub url: &'a str,
    pub secret: Option<&'a str>,
    pub timeout: Option<&'a str>,
    /// Half the relay's lease: a delivery must end within it.
    pub longest_timeout: Duration,
}

/// The HTTP target of a source or consumer, signed when it has a secret, giving up on a
/// delivery after its `timeout` (10 s by default, or half the lease if shorter, so that a
/// target that never answers holds a delivery slot briefly). `path` gives the path of a
/// key of the source or consumer.
pub fn destination<'p>(
    target: &Target<'_>,
    env: &Env,
    origin: &Origin<'_>,
    path: &dyn Fn(&'static str) -> [&'p str; 3],
) -> Result<HttpDestination> {
    let at = |key| origin.name(&path(key));
    let timeout = match target.timeout {
        Some(timeout) => parse_duration(timeout).with_context(|| at("timeout"))?,
        None => {
            let timeout = DEFAULT_TARGET_TIMEOUT.min(target.longest_timeout);
            origin.defaulted(&path("timeout"), quoted(&duration_text(timeout)));
            timeout
        }
    };
    if timeout.is_zero() || timeout > target.longest_timeout {
        bail!(
            "{}: must be more than zero and at most half of server.relay_lease ({} ms)",
            at("timeout"),
            target.longest_timeout.as_millis()
        );
    }
    let mut destination = HttpDestination::with_timeout(target.url, timeout)
        .with_context(|| format!("{}: must be an http:// or https:// URL", at("target")))?;
    if let Some(reference) = target.secret {
        destination = resolve_secret(reference, env)
            .and_then(|secret| Ok(destination.signed_with(&secret)?))
            .with_context(|| at("target_secret"))?;
    }
    Ok(destination)
}
