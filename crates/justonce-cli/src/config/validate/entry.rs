//! What a source and a consumer share: how errors name their keys, how long their keys are
//! kept, and the HTTP target they deliver to.

use super::secret::resolve_secret;
use super::units::duration_text;
use crate::config::read::{Env, Origin, quoted};
use anyhow::{Context, Result, anyhow, bail};
use justonce_cli_support::parse_duration;
use justonce_http::HttpDestination;
use justonce_sql::Retention;
use std::time::Duration;

/// How long a delivery waits for its target's answer unless the target says otherwise.
const DEFAULT_TARGET_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a source's or consumer's tenant comes from, as written.
pub enum TenantSetting<'t, L> {
    /// Every message is this tenant's.
    Fixed(&'t str),
    /// Each message names its tenant at `location`, one of `allowed`.
    Named { location: L, allowed: &'t [String] },
}

/// One source or consumer being validated.
pub struct Entry<'a, 'i> {
    /// `sources` or `consumers`.
    section: &'static str,
    name: &'a str,
    /// Half the relay's lease: a delivery must end within it.
    longest_timeout: Duration,
    env: &'a Env,
    origin: &'a Origin<'i>,
}

impl<'a, 'i> Entry<'a, 'i> {
    pub fn new(
        section: &'static str,
        name: &'a str,
        longest_timeout: Duration,
        env: &'a Env,
        origin: &'a Origin<'i>,
    ) -> Self {
        Self {
            section,
            name,
            longest_timeout,
            env,
            origin,
        }
    }

    /// The dotted path of the entry's `key`.
    pub fn path(&self, key: &'static str) -> [&'a str; 3] {
        [self.section, self.name, key]
    }

    /// How errors name the entry's `key`: with its line or the variable that set it.
    pub fn at(&self, key: &'static str) -> String {
        self.origin.name(&self.path(key))
    }

    /// How errors name the entry itself.
    pub fn named(&self) -> String {
        self.origin.name(&[self.section, self.name])
    }

    /// `value`, or else `default`, which `justonce config` then shows for `key`.
    pub fn or_default<'v>(
        &self,
        key: &'static str,
        value: Option<&'v str>,
        default: &'v str,
    ) -> &'v str {
        self.origin.or_default(&self.path(key), value, default)
    }

    /// The duration `key` holds, or else `default`.
    pub fn duration(
        &self,
        value: Option<&str>,
        default: &str,
        key: &'static str,
    ) -> Result<Duration> {
        parse_duration(self.or_default(key, value, default)).with_context(|| self.at(key))
    }

    /// How long keys are kept (`retention`, 7 days by default) and how long a sender may
    /// retry (`retry_horizon`, 3 days), which the keys must outlive.
    pub fn retention(&self, retry_horizon: Option<&str>, keep: Option<&str>) -> Result<Retention> {
        let retry_horizon = self.duration(retry_horizon, "3d", "retry_horizon")?;
        let keep = self.duration(keep, "7d", "retention")?;
        Retention::new(keep, retry_horizon).with_context(|| self.at("retention"))
    }

    /// How long a delivered event's body is kept to be replayed (`event_retention`): as
    /// long as its key by default, and never shorter, so that an event whose key is kept
    /// can be replayed.
    pub fn event_retention(
        &self,
        value: Option<&str>,
        keep: Option<&str>,
        retention: Retention,
    ) -> Result<Duration> {
        let event_retention = self.duration(value, keep.unwrap_or("7d"), "event_retention")?;
        if event_retention < retention.keep() {
            bail!(
                "{}: must be at least retention ({}): an event is kept at least as long as \
                 its key",
                self.at("event_retention"),
                keep.unwrap_or("7d")
            );
        }
        Ok(event_retention)
    }

    /// Where the entry's tenant comes from, as `tenant` and `tenants` say: none, a fixed
    /// name, or where each message names it (`header:NAME` or `json:/POINTER`, read by
    /// `location`) with the list of the tenants taken, which is required then so that a
    /// sender cannot make up tenants.
    pub fn tenant<'t, L>(
        &self,
        tenant: Option<&'t str>,
        tenants: Option<&'t [String]>,
        location: impl Fn(&str) -> Result<L, String>,
    ) -> Result<Option<TenantSetting<'t, L>>> {
        let Some(tenant) = tenant else {
            if tenants.is_some() {
                bail!(
                    "{}: only applies with tenant = \"header:NAME\" or \"json:/POINTER\"",
                    self.at("tenants")
                );
            }
            return Ok(None);
        };
        // A tenant's name has no ':', so one with it says where the message names it.
        if !tenant.contains(':') {
            if tenants.is_some() {
                bail!(
                    "{}: only applies when the message names its tenant; tenant {tenant:?} is \
                     fixed",
                    self.at("tenants")
                );
            }
            return Ok(Some(TenantSetting::Fixed(tenant)));
        }
        let location = location(tenant).map_err(|problem| {
            anyhow!(
                "{}: {problem}, or a tenant's name without ':'",
                self.at("tenant")
            )
        })?;
        let Some(tenants) = tenants else {
            bail!(
                "{}: is required with tenant = {tenant:?}: the tenants taken, so that a \
                 sender cannot make up tenants",
                self.at("tenants")
            );
        };
        if tenants.is_empty() {
            bail!("{}: must name at least one tenant", self.at("tenants"));
        }
        if let Some(twice) = tenants
            .iter()
            .enumerate()
            .find_map(|(i, name)| tenants[..i].contains(name).then_some(name))
        {
            bail!("{}: {twice:?} is listed twice", self.at("tenants"));
        }
        Ok(Some(TenantSetting::Named {
            location,
            allowed: tenants,
        }))
    }

    /// The HTTP target at `url`, signed when it has a `secret`, giving up on a delivery
    /// after its `timeout` (10 s by default, or half the lease if shorter, so that a target
    /// that never answers holds a delivery slot briefly).
    pub fn destination(
        &self,
        url: &str,
        secret: &Option<String>,
        timeout: &Option<String>,
    ) -> Result<HttpDestination> {
        let longest_timeout = self.longest_timeout;
        let timeout = match timeout.as_deref() {
            Some(timeout) => parse_duration(timeout).with_context(|| self.at("timeout"))?,
            None => {
                let timeout = DEFAULT_TARGET_TIMEOUT.min(longest_timeout);
                let path = self.path("timeout");
                self.origin
                    .defaulted(&path, quoted(&duration_text(timeout)));
                timeout
            }
        };
        if timeout.is_zero() || timeout > longest_timeout {
            bail!(
                "{}: must be more than zero and at most half of server.relay_lease ({} ms)",
                self.at("timeout"),
                longest_timeout.as_millis()
            );
        }
        let mut destination = HttpDestination::with_timeout(url, timeout).with_context(|| {
            format!("{}: must be an http:// or https:// URL", self.at("target"))
        })?;
        if let Some(reference) = secret {
            destination = resolve_secret(reference, self.env)
                .and_then(|secret| Ok(destination.signed_with(&secret)?))
                .with_context(|| self.at("target_secret"))?;
        }
        Ok(destination)
    }
}
