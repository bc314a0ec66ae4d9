//! Secrets, which the file names by reference only.

use crate::config::read::Env;
use anyhow::{Result, bail};

/// Secrets are references to environment variables (`env:NAME`), so that the file holds
/// none and no log prints one.
pub fn resolve_secret(reference: &str, env: &Env) -> Result<String> {
    let Some(variable) = reference.strip_prefix("env:") else {
        bail!("secrets are written env:VARIABLE, not given in the file");
    };
    match env.get(variable) {
        Some(secret) if !secret.is_empty() => Ok(secret.clone()),
        Some(_) => bail!("the environment variable {variable} is empty"),
        None => bail!("the environment variable {variable} is not set"),
    }
}
