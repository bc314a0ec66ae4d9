//! A webhook source: its signature scheme, secrets and where its event's id is.

use super::entry::{Entry, TenantSetting};
use super::secret::resolve_secret;
use crate::config::read::{Env, Origin, RawSource};
use crate::config::settings::SourceSettings;
use anyhow::{Context, Result, anyhow, bail};
use justonce_http::receiver::{IdLocation, Scheme, Source, Tenant};
use std::time::Duration;

/// The shortest signing secret a source takes.
const MIN_SECRET_BYTES: usize = 16;

/// The signature scheme a source names, read once: every later choice matches on it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SchemeKind {
    StandardWebhooks,
    Stripe,
    Github,
    HmacSha256,
    None,
}

impl SchemeKind {
    /// Every scheme, in the order an error lists them.
    const ALL: [SchemeKind; 5] = [
        SchemeKind::StandardWebhooks,
        SchemeKind::Stripe,
        SchemeKind::Github,
        SchemeKind::HmacSha256,
        SchemeKind::None,
    ];

    /// The scheme as `scheme = "..."` spells it.
    fn name(self) -> &'static str {
        match self {
            SchemeKind::StandardWebhooks => "standard-webhooks",
            SchemeKind::Stripe => "stripe",
            SchemeKind::Github => "github",
            SchemeKind::HmacSha256 => "hmac-sha256",
            SchemeKind::None => "none",
        }
    }

    fn of(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|scheme| scheme.name() == name)
    }

    /// Whether the scheme signs a timestamp, which `tolerance` bounds.
    fn signs_a_timestamp(self) -> bool {
        matches!(self, SchemeKind::StandardWebhooks | SchemeKind::Stripe)
    }

    /// Where the scheme's sender puts each event's id, if it has a place for it.
    fn default_id(self) -> Option<&'static str> {
        match self {
            SchemeKind::StandardWebhooks => Some("header:webhook-id"),
            SchemeKind::Stripe => Some("json:/id"),
            SchemeKind::Github => Some("header:X-GitHub-Delivery"),
            SchemeKind::HmacSha256 | SchemeKind::None => None,
        }
    }
}

/// The source `name` as written, checked: its scheme, secrets, id and target.
pub fn validate_source(
    name: &str,
    raw: RawSource,
    longest_timeout: Duration,
    env: &Env,
    origin: &Origin<'_>,
) -> Result<SourceSettings> {
    let entry = Entry::new("sources", name, longest_timeout, env, origin);
    let at = |key| entry.at(key);
    // First: what the other settings may be depends on the scheme, so a misspelt one must
    // not be reported as another setting's mistake.
    let Some(kind) = SchemeKind::of(&raw.scheme) else {
        let names: Vec<&str> = SchemeKind::ALL.iter().map(|s| s.name()).collect();
        bail!(
            "{}: {:?} is not one of {}",
            at("scheme"),
            raw.scheme,
            names.join(", ")
        );
    };
    let signs_a_timestamp = kind.signs_a_timestamp();
    if raw.tolerance.is_some() && !signs_a_timestamp {
        bail!(
            "{}: only applies to standard-webhooks and stripe, which sign a timestamp",
            at("tolerance")
        );
    }
    if raw.signature_header.is_some() && kind != SchemeKind::HmacSha256 {
        bail!("{}: only applies to hmac-sha256", at("signature_header"));
    }
    // Only the schemes that sign a timestamp have a tolerance.
    let tolerance = if signs_a_timestamp {
        let tolerance = entry.duration(raw.tolerance.as_deref(), "5m", "tolerance")?;
        if tolerance.is_zero() {
            bail!("{}: must be more than zero", at("tolerance"));
        }
        tolerance
    } else {
        Duration::ZERO
    };
    let retention = entry.retention(raw.retry_horizon.as_deref(), raw.retention.as_deref())?;
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
    let event_retention = entry.event_retention(
        raw.event_retention.as_deref(),
        raw.retention.as_deref(),
        retention,
    )?;
    let deliver_for = entry.duration(raw.deliver_for.as_deref(), "3d", "deliver_for")?;
    let secrets = raw
        .secrets
        .iter()
        .map(|reference| resolve_secret(reference, env))
        .collect::<Result<Vec<_>>>()
        .with_context(|| at("secrets"))?;
    match (kind, secrets.is_empty()) {
        (SchemeKind::None, false) => bail!("{}: scheme none takes no secrets", at("secrets")),
        (SchemeKind::None, true) => {}
        (scheme, true) => bail!(
            "{}: scheme {} needs at least one secret",
            at("secrets"),
            scheme.name()
        ),
        // A Standard Webhooks secret is checked once decoded, by its scheme.
        (SchemeKind::StandardWebhooks, false) => {}
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
    let scheme = match kind {
        SchemeKind::StandardWebhooks => {
            Scheme::standard_webhooks(&secrets, tolerance).with_context(|| at("secrets"))?
        }
        SchemeKind::Stripe => Scheme::Stripe {
            secrets: as_bytes(),
            tolerance,
        },
        SchemeKind::Github => Scheme::Github {
            secrets: as_bytes(),
        },
        SchemeKind::HmacSha256 => {
            let header = entry.or_default(
                "signature_header",
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
        SchemeKind::None => Scheme::None,
    };
    let id = match (raw.id.as_deref(), kind.default_id()) {
        (None, Some(default)) => Some(entry.or_default("id", None, default)),
        (id, _) => id,
    };
    let id = id.ok_or_else(|| {
        anyhow!(
            "{}: is required for scheme {}: \"header:NAME\" or \"json:/POINTER\"",
            at("id"),
            kind.name()
        )
    })?;
    let id = location(id).map_err(|problem| anyhow!("{}: {problem}", at("id")))?;
    let mut source = Source::new(name, scheme, id).with_context(|| entry.named())?;
    if let Some(tenant) = validate_tenant(&entry, raw.tenant.as_deref(), raw.tenants.as_deref())? {
        source = source.with_tenant(tenant);
    }
    Ok(SourceSettings {
        name: name.to_owned(),
        source,
        retention,
        event_retention,
        destination: entry.destination(&raw.target, &raw.target_secret, &raw.timeout)?,
        deliver_for,
    })
}

/// Where a request holds a value, as `id` and `tenant` spell it: `header:NAME` or
/// `json:/POINTER`.
fn location(text: &str) -> Result<IdLocation, String> {
    match text.split_once(':') {
        Some(("header", header)) => header
            .parse()
            .map(IdLocation::Header)
            .map_err(|_| format!("{header:?} is not a header name")),
        Some(("json", pointer)) if pointer.starts_with('/') => {
            Ok(IdLocation::Json(pointer.to_owned()))
        }
        _ => Err(format!(
            "{text:?} must be \"header:NAME\" or \"json:/POINTER\""
        )),
    }
}

/// The source's tenant, if it has tenants: a fixed name, or where each request names it,
/// with the list of tenants taken.
fn validate_tenant(
    entry: &Entry<'_, '_>,
    tenant: Option<&str>,
    tenants: Option<&[String]>,
) -> Result<Option<Tenant>> {
    let at = |key| entry.at(key);
    match entry.tenant(tenant, tenants, location)? {
        None => Ok(None),
        Some(TenantSetting::Fixed(tenant)) => Tenant::fixed(tenant)
            .map(Some)
            .with_context(|| at("tenant")),
        Some(TenantSetting::Named { location, allowed }) => {
            Tenant::from_request(location, allowed.iter().cloned())
                .map(Some)
                .with_context(|| at("tenants"))
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{SHOP, env_of, error_of, load_text, shop_and_orders};
    use std::time::Duration;

    /// An event is kept at least as long as its key: as long by default, longer if set,
    /// never shorter.
    #[test]
    fn event_retention_is_at_least_the_retention() {
        const DAY: Duration = Duration::from_secs(86_400);
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://127.0.0.1:5672"),
        ]);
        let settings = load_text(&shop_and_orders(), &env).unwrap();
        assert_eq!(settings.sources[0].event_retention, 7 * DAY);
        assert_eq!(settings.consumers[0].event_retention, 7 * DAY);
        let longer = shop_and_orders()
            .replace(
                "[sources.shop]",
                "[sources.shop]\nretention = \"10d\"\nevent_retention = \"30d\"",
            )
            .replace(
                "[consumers.orders]",
                "[consumers.orders]\nevent_retention = \"14d\"",
            );
        let settings = load_text(&longer, &env).unwrap();
        assert_eq!(settings.sources[0].event_retention, 30 * DAY);
        assert_eq!(settings.consumers[0].event_retention, 14 * DAY);
        let shorter = SHOP.replace(
            "[sources.shop]",
            "[sources.shop]\nretention = \"10d\"\nevent_retention = \"2d\"",
        );
        let error = error_of(&shorter, &env);
        assert!(
            error.contains("sources.shop.event_retention (line 8)"),
            "{error}"
        );
        assert!(
            error.contains("must be at least retention (10d)"),
            "{error}"
        );
        let consumer = shop_and_orders().replace(
            "[consumers.orders]",
            "[consumers.orders]\nevent_retention = \"1d\"",
        );
        let error = error_of(&consumer, &env);
        assert!(
            error.contains("consumers.orders.event_retention"),
            "{error}"
        );
        assert!(error.contains("must be at least retention (7d)"), "{error}");
    }

    /// A source's tenant is fixed, or named by the request and then one of a list that
    /// must be given; every mistake is named by its setting.
    #[test]
    fn a_tenant_is_fixed_or_named_by_the_request_from_a_list() {
        use justonce_http::receiver::{IdLocation, Tenant};
        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0")]);
        let with =
            |lines: &str| SHOP.replace("[sources.shop]", &format!("[sources.shop]\n{lines}"));
        let tenant_of = |text: &str| load_text(text, &env).unwrap().sources.remove(0).source;
        let source = tenant_of(&with(
            "tenant = \"header:X-Tenant\"\ntenants = [\"acme\", \"globex\"]",
        ));
        match source.tenant() {
            Some(Tenant::FromRequest {
                location: IdLocation::Header(header),
                allowed,
            }) => {
                assert_eq!(header.as_str(), "x-tenant");
                assert_eq!(Vec::from_iter(allowed), ["acme", "globex"]);
            }
            other => panic!("{other:?}"),
        }
        let source = tenant_of(&with(
            "tenant = \"json:/account/tenant\"\ntenants = [\"acme\"]",
        ));
        assert!(matches!(
            source.tenant(),
            Some(Tenant::FromRequest { location: IdLocation::Json(pointer), .. }) if pointer == "/account/tenant"
        ));
        let source = tenant_of(&with("tenant = \"acme\""));
        assert!(matches!(source.tenant(), Some(Tenant::Fixed(scope)) if scope.as_str() == "acme"));
        assert!(tenant_of(SHOP).tenant().is_none());
        // The list from a variable, comma-separated as secrets are.
        let listed = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("JUSTONCE_SOURCES_SHOP_TENANTS", "acme, globex"),
        ]);
        let settings = load_text(&with("tenant = \"header:X-Tenant\""), &listed).unwrap();
        assert!(matches!(
            settings.sources[0].source.tenant(),
            Some(Tenant::FromRequest { allowed, .. }) if allowed.len() == 2 && allowed.contains("globex")
        ));
        for (lines, setting, expected) in [
            (
                "tenant = \"header:X-Tenant\"",
                "sources.shop.tenants",
                "is required with tenant = \"header:X-Tenant\"",
            ),
            (
                "tenant = \"json:/tenant\"\ntenants = []",
                "sources.shop.tenants",
                "must name at least one tenant",
            ),
            (
                "tenants = [\"acme\"]",
                "sources.shop.tenants",
                "only applies with tenant = \"header:NAME\"",
            ),
            (
                "tenant = \"acme\"\ntenants = [\"acme\"]",
                "sources.shop.tenants",
                "tenant \"acme\" is fixed",
            ),
            (
                "tenant = \"query:tenant\"",
                "sources.shop.tenant",
                "must be \"header:NAME\" or \"json:/POINTER\"",
            ),
            (
                "tenant = \"json:tenant\"\ntenants = [\"acme\"]",
                "sources.shop.tenant",
                "must be \"header:NAME\"",
            ),
            (
                "tenant = \"header:X Tenant\"\ntenants = [\"acme\"]",
                "sources.shop.tenant",
                "is not a header name",
            ),
            (
                "tenant = \"header:X-Tenant\"\ntenants = [\"acme\", \"acme\"]",
                "sources.shop.tenants",
                "\"acme\" is listed twice",
            ),
            (
                "tenant = \"header:X-Tenant\"\ntenants = [\"acme\", \"\"]",
                "sources.shop.tenants",
                "invalid scope",
            ),
            (
                "tenant = \"header:X-Tenant\"\ntenants = [\"a/b\", \"a:b\"]",
                "sources.shop.tenants",
                "may not contain ':'",
            ),
        ] {
            let error = error_of(&with(lines), &env);
            assert!(error.contains(setting), "{setting:?} not in {error:?}");
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
        }
        // A consumer's tenant is fixed, or named by each message from a list.
        let env = env_of(&[
            ("SHOP_SECRET", "whsec_c2VjcmV0"),
            ("ORDERS_BROKER", "amqp://127.0.0.1:5672"),
        ]);
        let consumer = |tenant: &str| {
            shop_and_orders().replace(
                "[consumers.orders]",
                &format!("[consumers.orders]\ntenant = \"{tenant}\""),
            )
        };
        let settings = load_text(&consumer("initech"), &env).unwrap();
        let tenant = settings.consumers[0].tenant.as_ref().map(|t| t.as_str());
        assert_eq!(tenant, Some("initech"));
        assert!(
            load_text(&shop_and_orders(), &env).unwrap().consumers[0]
                .tenant
                .is_none()
        );
        let error = error_of(&consumer("header:X-Tenant"), &env);
        assert!(error.contains("consumers.orders.tenants"), "{error}");
        assert!(error.contains("is required"), "{error}");
        let listed = consumer("json:/tenant").replace(
            "tenant = \"json:/tenant\"",
            "tenant = \"json:/tenant\"\ntenants = [\"acme\", \"globex\"]",
        );
        let settings = load_text(&listed, &env).unwrap();
        assert!(settings.consumers[0].tenant.is_none());
        let options = format!("{:?}", settings.consumers[0].options);
        assert!(options.contains("Json(\"/tenant\")"), "{options}");
        assert!(options.contains("\"globex\""), "{options}");
    }

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
