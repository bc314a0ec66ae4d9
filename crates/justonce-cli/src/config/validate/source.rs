//! A webhook source: its signature scheme, secrets and where its event's id is.

use super::entry::{Entry, TenantSetting};
use super::secret::resolve_secret;
use crate::config::read::{Env, Origin, RawSource};
use crate::config::settings::SourceSettings;
use anyhow::{Context, Result, anyhow, bail};
use justonce_http::receiver::{IdLocation, Scheme, Source, Tenant, TenantSecrets};
use std::collections::BTreeMap;
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
    // The header is read even when a tenant's secrets, not the source's, are checked.
    let signature_header = match kind {
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
            header.to_ascii_lowercase()
        }
        _ => String::new(),
    };
    let signing = Signing {
        kind,
        tolerance,
        signature_header,
    };
    let by_tenant = match &raw.tenant_secrets {
        None => None,
        Some(_) if !raw.secrets.is_empty() => bail!(
            "{}: give either secrets or tenant_secrets: with tenant_secrets, each tenant's \
             secrets name its events' tenant",
            at("secrets")
        ),
        Some(_) if kind == SchemeKind::None => {
            bail!("{}: scheme none takes no secrets", at("tenant_secrets"))
        }
        Some(by_tenant) => Some(tenant_schemes(&entry, &signing, by_tenant, env)?),
    };
    let scheme = match by_tenant {
        Some(_) => Scheme::None,
        None => {
            let secrets = raw
                .secrets
                .iter()
                .map(|reference| resolve_secret(reference, env))
                .collect::<Result<Vec<_>>>()
                .with_context(|| at("secrets"))?;
            signing
                .scheme(&secrets)
                .map_err(|problem| anyhow!("{}: {problem}", at("secrets")))?
        }
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
    let tenant = match by_tenant {
        Some(schemes) => Some(secrets_tenant(&entry, &raw, schemes)?),
        None => validate_tenant(&entry, raw.tenant.as_deref(), raw.tenants.as_deref())?,
    };
    if let Some(tenant) = tenant {
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

/// How a source's scheme checks signatures, whoever's secrets it holds.
struct Signing {
    kind: SchemeKind,
    tolerance: Duration,
    /// The header of an hmac-sha256 signature, in lower case.
    signature_header: String,
}

impl Signing {
    /// The scheme holding `secrets`, resolved, or what is wrong with them; a problem never
    /// shows a secret.
    fn scheme(&self, secrets: &[String]) -> Result<Scheme, String> {
        match (self.kind, secrets.is_empty()) {
            (SchemeKind::None, false) => return Err("scheme none takes no secrets".to_owned()),
            (SchemeKind::None, true) => return Ok(Scheme::None),
            (scheme, true) => {
                return Err(format!(
                    "scheme {} needs at least one secret",
                    scheme.name()
                ));
            }
            // A Standard Webhooks secret is checked once decoded, by its scheme.
            (SchemeKind::StandardWebhooks, false) => {
                return Scheme::standard_webhooks(secrets, self.tolerance)
                    .map_err(|error| error.to_string());
            }
            _ => {}
        }
        if let Some(short) = secrets.iter().position(|s| s.len() < MIN_SECRET_BYTES) {
            return Err(format!(
                "secret {} of the list is shorter than {MIN_SECRET_BYTES} bytes: a short \
                 secret can be guessed from one signed request",
                short + 1
            ));
        }
        let secrets = secrets.iter().map(|s| s.as_bytes().to_vec()).collect();
        Ok(match self.kind {
            SchemeKind::Stripe => Scheme::Stripe {
                secrets,
                tolerance: self.tolerance,
            },
            SchemeKind::Github => Scheme::Github { secrets },
            _ => Scheme::HmacSha256 {
                secrets,
                header: self.signature_header.clone(),
            },
        })
    }
}

/// Each tenant of `tenant_secrets` with the scheme holding its secrets. One secret given to
/// two tenants is refused: it could not say whose an event is.
fn tenant_schemes(
    entry: &Entry<'_, '_>,
    signing: &Signing,
    by_tenant: &BTreeMap<String, Vec<String>>,
    env: &Env,
) -> Result<Vec<(String, Scheme)>> {
    let at = || entry.at("tenant_secrets");
    if by_tenant.is_empty() {
        bail!("{}: must name at least one tenant", at());
    }
    let mut seen: Vec<(&str, String)> = Vec::new();
    let mut schemes = Vec::new();
    for (tenant, references) in by_tenant {
        let secrets = references
            .iter()
            .map(|reference| resolve_secret(reference, env))
            .collect::<Result<Vec<_>>>()
            .with_context(|| format!("{}: tenant {tenant:?}", at()))?;
        for secret in &secrets {
            if let Some((other, _)) = seen.iter().find(|(_, seen)| seen == secret) {
                bail!(
                    "{}: tenants {other:?} and {tenant:?} share a secret, which could not say \
                     whose an event is",
                    at()
                );
            }
        }
        seen.extend(
            secrets
                .iter()
                .map(|secret| (tenant.as_str(), secret.clone())),
        );
        let scheme = signing
            .scheme(&secrets)
            .map_err(|problem| anyhow!("{}: tenant {tenant:?}: {problem}", at()))?;
        schemes.push((tenant.clone(), scheme));
    }
    Ok(schemes)
}

/// The tenant of a source whose tenants sign with their own secrets: the secret's, which a
/// request that names its tenant (`tenant = "header:NAME"` or `"json:/POINTER"`) must
/// name too. The tenants are those of `tenant_secrets`, so `tenants` is not given.
fn secrets_tenant(
    entry: &Entry<'_, '_>,
    raw: &RawSource,
    schemes: Vec<(String, Scheme)>,
) -> Result<Tenant> {
    let at = |key| entry.at(key);
    if raw.tenants.is_some() {
        bail!(
            "{}: the tenants are those of tenant_secrets; leave tenants out",
            at("tenants")
        );
    }
    let named = match raw.tenant.as_deref() {
        None => None,
        Some(tenant) => Some(location(tenant).map_err(|problem| {
            anyhow!(
                "{}: {problem}: with tenant_secrets the secret names the tenant, and a request \
                 may name it too",
                at("tenant")
            )
        })?),
    };
    let secrets = TenantSecrets::new(schemes, named).with_context(|| at("tenant_secrets"))?;
    Ok(Tenant::BySecret(secrets))
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

    /// Each tenant signs with its own secrets, from the file or one variable; every mistake
    /// is named by its setting, never with a secret.
    #[test]
    fn tenant_secrets_give_each_tenant_its_own() {
        use justonce_http::receiver::Tenant;
        let by_secret = SHOP.replace(
            "secrets = [\"env:SHOP_SECRET\"]\ntarget = \"http://127.0.0.1:9000/hooks/shop\"\n",
            "target = \"http://127.0.0.1:9000/hooks/shop\"\n\n[sources.shop.tenant_secrets]\n\
             acme = [\"env:ACME\"]\nglobex = [\"env:GLOBEX\", \"env:GLOBEX_OLD\"]\n",
        );
        let env = env_of(&[
            ("ACME", "whsec_YWNtZQ=="),
            ("GLOBEX", "whsec_Z2xvYmV4"),
            ("GLOBEX_OLD", "whsec_b2xk"),
        ]);
        let tenants = |text: &str, env| -> Vec<String> {
            let settings = load_text(text, env).unwrap();
            match settings.sources[0].source.tenant() {
                Some(Tenant::BySecret(secrets)) => {
                    secrets.tenants().map(|t| t.as_str().to_owned()).collect()
                }
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(tenants(&by_secret, &env), ["acme", "globex"]);
        let no_file = SHOP.replace("secrets = [\"env:SHOP_SECRET\"]\n", "");
        let from_variable = env_of(&[
            ("ACME", "whsec_YWNtZQ=="),
            ("GLOBEX", "whsec_Z2xvYmV4"),
            (
                "JUSTONCE_SOURCES_SHOP_TENANT_SECRETS",
                "acme=env:ACME, globex=env:GLOBEX",
            ),
        ]);
        assert_eq!(tenants(&no_file, &from_variable), ["acme", "globex"]);
        let shared = env_of(&[
            ("ACME", "whsec_YWNtZQ=="),
            ("GLOBEX", "whsec_YWNtZQ=="),
            ("GLOBEX_OLD", "whsec_b2xk"),
        ]);
        let error = error_of(&by_secret, &shared);
        assert!(error.contains("sources.shop.tenant_secrets"), "{error}");
        assert!(error.contains("share a secret"), "{error}");
        assert!(!error.contains("YWNtZQ"), "a secret was printed: {error}");
        for (lines, setting, expected) in [
            (
                "secrets = [\"env:ACME\"]",
                "sources.shop.secrets",
                "give either secrets or tenant_secrets",
            ),
            (
                "tenant = \"acme\"",
                "sources.shop.tenant",
                "must be \"header:NAME\"",
            ),
            (
                "tenant = \"header:X-Tenant\"\ntenants = [\"acme\"]",
                "sources.shop.tenants",
                "leave tenants out",
            ),
        ] {
            let text = by_secret.replace("[sources.shop]\n", &format!("[sources.shop]\n{lines}\n"));
            let error = error_of(&text, &env);
            assert!(error.contains(setting), "{setting:?} not in {error:?}");
            assert!(error.contains(expected), "{expected:?} not in {error:?}");
        }
        let named = by_secret.replace(
            "[sources.shop]\n",
            "[sources.shop]\ntenant = \"header:X-Tenant\"\n",
        );
        assert_eq!(tenants(&named, &env), ["acme", "globex"]);
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
