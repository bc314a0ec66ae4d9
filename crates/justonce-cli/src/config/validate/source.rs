//! A webhook source: its signature scheme, secrets and where its event's id is.

use super::secret::resolve_secret;
use super::target::{Target, destination};
use crate::config::read::{Env, Origin, RawSource};
use crate::config::settings::SourceSettings;
use anyhow::{Context, Result, anyhow, bail};
use justonce_cli_support::parse_duration;
use justonce_http::receiver::{IdLocation, Scheme, Source};
use justonce_sql::Retention;
use std::time::Duration;

/// The shortest signing secret a source takes.
const MIN_SECRET_BYTES: usize = 16;

/// The signature scheme a source names, read once: every later choice matches on it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SchemeName {
    StandardWebhooks,
    Stripe,
    Github,
    HmacSha256,
    None,
}

impl SchemeName {
    /// Every scheme, in the order an error lists them.
    const ALL: [SchemeName; 5] = [
        SchemeName::StandardWebhooks,
        SchemeName::Stripe,
        SchemeName::Github,
        SchemeName::HmacSha256,
        SchemeName::None,
    ];

    /// The scheme as `scheme = "..."` spells it.
    fn name(self) -> &'static str {
        match self {
            SchemeName::StandardWebhooks => "standard-webhooks",
            SchemeName::Stripe => "stripe",
            SchemeName::Github => "github",
            SchemeName::HmacSha256 => "hmac-sha256",
            SchemeName::None => "none",
        }
    }

    fn of(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|scheme| scheme.name() == name)
    }

    /// Whether the scheme signs a timestamp, which `tolerance` bounds.
    fn signs_a_timestamp(self) -> bool {
        matches!(self, SchemeName::StandardWebhooks | SchemeName::Stripe)
    }

    /// Where the scheme's sender puts each event's id, if it has a place for it.
    fn default_id(self) -> Option<&'static str> {
        match self {
            SchemeName::StandardWebhooks => Some("header:webhook-id"),
            SchemeName::Stripe => Some("json:/id"),
            SchemeName::Github => Some("header:X-GitHub-Delivery"),
            SchemeName::HmacSha256 | SchemeName::None => None,
        }
    }
}

pub fn validate_source(
    name: &str,
    raw: RawSource,
    longest_timeout: Duration,
    env: &Env,
    origin: &Origin<'_>,
) -> Result<SourceSettings> {
    let path = |key: &'static str| ["sources", name, key];
    let at = |key: &'static str| origin.name(&path(key));
    let duration = |value: Option<&str>, default: &str, key: &'static str| {
        parse_duration(origin.or_default(&path(key), value, default)).with_context(|| at(key))
    };
    // First: what the other settings may be depends on the scheme, so a misspelt one must
    // not be reported as another setting's mistake.
    let Some(scheme_name) = SchemeName::of(&raw.scheme) else {
        let names: Vec<&str> = SchemeName::ALL.iter().map(|s| s.name()).collect();
        bail!(
            "{}: {:?} is not one of {}",
            at("scheme"),
            raw.scheme,
            names.join(", ")
        );
    };
    let signs_a_timestamp = scheme_name.signs_a_timestamp();
    if raw.tolerance.is_some() && !signs_a_timestamp {
        bail!(
            "{}: only applies to standard-webhooks and stripe, which sign a timestamp",
            at("tolerance")
        );
    }
    if raw.signature_header.is_some() && scheme_name != SchemeName::HmacSha256 {
        bail!("{}: only applies to hmac-sha256", at("signature_header"));
    }
    // Only the schemes that sign a timestamp have a tolerance.
    let tolerance = if signs_a_timestamp {
        let tolerance = duration(raw.tolerance.as_deref(), "5m", "tolerance")?;
        if tolerance.is_zero() {
            bail!("{}: must be more than zero", at("tolerance"));
        }
        tolerance
    } else {
        Duration::ZERO
    };
    let retry_horizon = duration(raw.retry_horizon.as_deref(), "3d", "retry_horizon")?;
    let keep = duration(raw.retention.as_deref(), "7d", "retention")?;
    let retention = Retention::new(keep, retry_horizon).with_context(|| at("retention"))?;
    // A signed event sent again after its key was purged, still within the tolerance,
    // would be taken as new and act twice.
    if signs_a_timestamp && tolerance >= retention.keep() {
        bail!(
            "{}: must be shorter than retention ({}), or an event replayed after its key \
             was purged would act twice",
            at("tolerance"),
            raw.retention.as_deref().unwrap_or("7d")
        );
    }
    let deliver_for = duration(raw.deliver_for.as_deref(), "3d", "deliver_for")?;
    let secrets = raw
        .secrets
        .iter()
        .map(|reference| resolve_secret(reference, env))
        .collect::<Result<Vec<_>>>()
        .with_context(|| at("secrets"))?;
    match (scheme_name, secrets.is_empty()) {
        (SchemeName::None, false) => bail!("{}: scheme none takes no secrets", at("secrets")),
        (SchemeName::None, true) => {}
        (scheme, true) => bail!(
            "{}: scheme {} needs at least one secret",
            at("secrets"),
            scheme.name()
        ),
        // A Standard Webhooks secret is checked once decoded, by its scheme.
        (SchemeName::StandardWebhooks, false) => {}
        _ => {
            if let Some(short) = secrets.iter().position(|s| s.len() < MIN_SECRET_BYTES) {
                bail!(
                    "{}: secret {} of the list is shorter than {MIN_SECRET_BYTES} bytes: \
                     a short secret can be guessed from one signed request",
                    at("secrets"),
                    short + 1
                );
            }
        }
    }
    let as_bytes = || {
        secrets
            .iter()
            .map(|s| s.as_bytes().to_vec())
            .collect::<Vec<_>>()
    };
    let scheme = match scheme_name {
        SchemeName::StandardWebhooks => {
            Scheme::standard_webhooks(&secrets, tolerance).with_context(|| at("secrets"))?
        }
        SchemeName::Stripe => Scheme::Stripe {
            secrets: as_bytes(),
            tolerance,
        },
        SchemeName::Github => Scheme::Github {
            secrets: as_bytes(),
        },
        SchemeName::HmacSha256 => {
            let header = origin.or_default(
                &path("signature_header"),
                raw.signature_header.as_deref(),
                "X-Signature",
            );
            axum::http::HeaderName::try_from(header).map_err(|_| {
                anyhow!(
                    "{}: {header:?} is not a header name",
                    at("signature_header")
                )
            })?;
            Scheme::HmacSha256 {
                secrets: as_bytes(),
                header: header.to_ascii_lowercase(),
            }
        }
        SchemeName::None => Scheme::None,
    };
    let id = match (raw.id.as_deref(), scheme_name.default_id()) {
        (None, Some(default)) => Some(origin.or_default(&path("id"), None, default)),
        (id, _) => id,
    };
    let id = id.ok_or_else(|| {
        anyhow!(
            "{}: is required for scheme {}: \"header:NAME\" or \"json:/POINTER\"",
            at("id"),
            scheme_name.name()
        )
    })?;
    let id = match id.split_once(':') {
        Some(("header", header)) => IdLocation::Header(
            header
                .parse()
                .map_err(|_| anyhow!("{}: {header:?} is not a header name", at("id")))?,
        ),
        Some(("json", pointer)) if pointer.starts_with('/') => IdLocation::Json(pointer.to_owned()),
        _ => bail!(
            "{}: {id:?} must be \"header:NAME\" or \"json:/POINTER\"",
            at("id")
        ),
    };
    Ok(SourceSettings {
        name: name.to_owned(),
        source: Source::new(name, scheme, id).with_context(|| origin.name(&["sources", name]))?,
        retention,
        destination: destination(
            &Target {
                url: &raw.target,
                secret: raw.target_secret.as_deref(),
                timeout: raw.timeout.as_deref(),
                longest_timeout,
            },
            env,
            origin,
            &path,
        )?,
        deliver_for,
    })
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{SHOP, env_of, error_of, load_text};

    #[test]
    fn empty_secrets_are_refused() {
        let env = env_of(&[("SHOP_SECRET", "")]);
        let error = error_of(SHOP, &env);
        assert!(error.contains("SHOP_SECRET is empty"), "{error}");
        let none = SHOP.replace("standard-webhooks", "none");
        let env = env_of(&[("SHOP_SECRET", "x")]);
        let error = error_of(&none, &env);
        assert!(error.contains("takes no secrets"), "{error}");
    }

    /// Standard Webhooks secrets and public keys mix in one list; an unusable one is named
    /// by its setting and position, never printed.
    #[test]
    fn standard_webhooks_takes_whsec_and_whpk_entries() {
        let both = SHOP.replace(
            "\"env:SHOP_SECRET\"",
            "\"env:SHOP_SECRET\", \"env:SHOP_KEY\"",
        );
        // The public key of RFC 8032's first test vector.
        let whpk = "whpk_11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=";
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0"), ("SHOP_KEY", whpk)]);
        load_text(&both, &env).unwrap();
        for (secret, key, expected) in [
            (
                "whsec_",
                "whpk_11qYAYKxCrfVS/7TyWQHOg7hcvPapiMlrwIaaPcHURo=",
                "secret 1 of 2: a Standard Webhooks secret is empty",
            ),
            (
                "whsec_c2VjcmV0",
                "whpk_c2VjcmV0",
                "secret 2 of 2: a Standard Webhooks public key must hold 32 bytes",
            ),
        ] {
            let env = env_of(&[("SHOP_SECRET", secret), ("SHOP_KEY", key)]);
            let error = error_of(&both, &env);
            assert!(error.contains("sources.shop.secrets (line 8)"), "{error}");
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
            assert!(!error.contains("c2VjcmV0"), "a secret was printed: {error}");
        }
    }
}
