//! A source's tenant: fixed by its configuration, named by each request and checked
//! against the source's list of tenants, or named by the secret that signed the request.

use super::signature::Rejected;
use super::{IdLocation, Scheme, located_text};
use axum::http::HeaderMap;
use justonce_core::{Error, Key, Scope};
use std::collections::BTreeSet;

/// Where a source's tenant comes from. Each event is claimed and stored in its tenant's
/// scope, and its key is `<source>:<tenant>:<id>`.
#[derive(Debug, Clone)]
pub enum Tenant {
    /// Every event of the source is this tenant's.
    Fixed(Scope),
    /// Each request names its tenant there, and only a tenant in `allowed` is taken: a
    /// sender cannot make up scopes.
    FromRequest {
        /// Where the request names its tenant.
        location: IdLocation,
        /// The tenants the source takes.
        allowed: BTreeSet<String>,
    },
    /// Each tenant signs with secrets of its own: the secret that verifies a request names
    /// its tenant. The source's own scheme is not used.
    BySecret(TenantSecrets),
}

/// The signing secrets of each tenant of a source, and where a request may name its
/// tenant too.
#[derive(Debug, Clone)]
pub struct TenantSecrets {
    /// Each tenant with the scheme that holds its secrets (several during a rotation).
    schemes: Vec<(Scope, Scheme)>,
    /// Where a request names its tenant, if it does: the name must be the secret's.
    named: Option<IdLocation>,
}

impl TenantSecrets {
    /// Each tenant of `schemes` (at least one, each once) verifies with its scheme's
    /// secrets; a request that also names its tenant at `named` must name the secret's.
    pub fn new<I, T>(schemes: I, named: Option<IdLocation>) -> Result<Self, Error>
    where
        I: IntoIterator<Item = (T, Scheme)>,
        T: AsRef<str>,
    {
        let mut checked: Vec<(Scope, Scheme)> = Vec::new();
        for (tenant, scheme) in schemes {
            let scope = tenant_scope(tenant.as_ref())?;
            if checked.iter().any(|(other, _)| *other == scope) {
                return Err(Error::Config(format!(
                    "tenant {:?} is given twice",
                    tenant.as_ref()
                )));
            }
            checked.push((scope, scheme));
        }
        if checked.is_empty() {
            return Err(Error::Config(
                "tenants named by their secrets need at least one tenant".to_owned(),
            ));
        }
        Ok(Self {
            schemes: checked,
            named,
        })
    }

    /// The tenants, in the order given.
    pub fn tenants(&self) -> impl Iterator<Item = &Scope> {
        self.schemes.iter().map(|(scope, _)| scope)
    }

    /// The tenant whose secret verifies the request. Every tenant's scheme is tried, so
    /// that the time taken does not tell whose secret matched.
    pub(super) fn signer(&self, headers: &HeaderMap, body: &[u8]) -> Result<&Scope, Rejected> {
        let mut signer = None;
        for (scope, scheme) in &self.schemes {
            if scheme.verify(headers, body).is_ok() {
                signer = signer.or(Some(scope));
            }
        }
        signer.ok_or(Rejected)
    }
}

impl Tenant {
    /// Every event of the source is `tenant`'s.
    pub fn fixed(tenant: &str) -> Result<Self, Error> {
        Ok(Self::Fixed(tenant_scope(tenant)?))
    }

    /// Each request names its tenant at `location`, one of `allowed` (at least one).
    pub fn from_request<I, T>(location: IdLocation, allowed: I) -> Result<Self, Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let allowed: BTreeSet<String> = allowed.into_iter().map(Into::into).collect();
        if allowed.is_empty() {
            return Err(Error::Config(
                "a tenant named by the request needs a list of the tenants taken".to_owned(),
            ));
        }
        for tenant in &allowed {
            tenant_scope(tenant)?;
        }
        Ok(Self::FromRequest { location, allowed })
    }

    /// The request's tenant as a scope, or why it is refused; `signer` is the tenant
    /// whose secret verified it, under [`Tenant::BySecret`].
    pub(super) fn of(
        &self,
        headers: &HeaderMap,
        body: &[u8],
        signer: Option<&Scope>,
    ) -> Result<Scope, Refused> {
        match self {
            Self::Fixed(scope) => Ok(scope.clone()),
            Self::BySecret(secrets) => {
                let signer = signer.ok_or(Refused::NotAllowed)?;
                if let Some(location) = &secrets.named {
                    let named = located_text(location, headers, body, "tenant")
                        .map_err(Refused::Missing)?;
                    // Signed by one tenant, claiming another: never echoed either.
                    if named != signer.as_str() {
                        return Err(Refused::NotAllowed);
                    }
                }
                Ok(signer.clone())
            }
            Self::FromRequest { location, allowed } => {
                let named =
                    located_text(location, headers, body, "tenant").map_err(Refused::Missing)?;
                if !allowed.contains(&named) {
                    // The name is the sender's: never echoed, so that it cannot fill logs.
                    return Err(Refused::NotAllowed);
                }
                Scope::new(named).map_err(|_| Refused::NotAllowed)
            }
        }
    }
}

/// Why a request's tenant is refused.
#[derive(Debug)]
pub(super) enum Refused {
    /// The request names no tenant where the source looks for it.
    Missing(String),
    /// The request names a tenant the source does not take.
    NotAllowed,
}

/// `tenant` as a scope. It becomes a part of keys, so it may not hold the key separator:
/// `a:b` with id `c` and `a` with id `b:c` would both be keyed `<source>:a:b:c`.
fn tenant_scope(tenant: &str) -> Result<Scope, Error> {
    if tenant.contains(Key::SEPARATOR) {
        return Err(Error::Config(format!(
            "tenant {tenant:?} may not contain ':'"
        )));
    }
    Scope::new(tenant).map_err(|error| Error::Config(format!("tenant {tenant:?}: {error}")))
}
