//! A source's tenant: fixed by its configuration, or named by each request and checked
//! against the source's list of tenants.

use super::{IdLocation, located_text};
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

    /// The request's tenant as a scope, or why it is refused.
    pub(super) fn of(&self, headers: &HeaderMap, body: &[u8]) -> Result<Scope, Refused> {
        match self {
            Self::Fixed(scope) => Ok(scope.clone()),
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
