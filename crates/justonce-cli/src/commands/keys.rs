//! `justonce keys`: show a claimed key; release or complete a lease whose worker is stuck.

use super::output::{confirm, scope_or_none};
use crate::cli::{KeyArgs, KeysCommand};
use anyhow::{Context, Result};
use justonce_cli_support::Usage;
use justonce_sql::{Backend, Consumer, Identity, Inbox, Key, Scope, StoredKey};

/// Runs one `keys` command on the inbox; `release` and `complete` ask first.
pub async fn run<DB: Backend>(inbox: &Inbox<DB>, command: KeysCommand) -> Result<()> {
    match command {
        KeysCommand::Show { key } => {
            let identity = key.identity()?;
            let stored = lookup(inbox, &identity).await?;
            print_key(&identity, &stored);
        }
        KeysCommand::Release { key, yes } => {
            let identity = key.identity()?;
            show_lease_in_progress(inbox, &identity, "release").await?;
            confirm("Release this key, so that the next claim takes it?", yes)?;
            if !inbox.release_key(&identity).await? {
                anyhow::bail!("{} has no lease in progress any more", name(&identity));
            }
            println!("released: the next claim takes {} at once", identity.key);
        }
        KeysCommand::Complete { key, result, yes } => {
            let identity = key.identity()?;
            show_lease_in_progress(inbox, &identity, "complete").await?;
            let stored = match &result {
                Some(result) => format!("{} bytes of result", result.len()),
                None => "no result".to_owned(),
            };
            confirm(&format!("Mark this key done, with {stored}?"), yes)?;
            let result = result.as_deref().map(str::as_bytes);
            if !inbox.complete_key(&identity, result).await? {
                anyhow::bail!("{} has no lease in progress any more", name(&identity));
            }
            println!("completed: {} is done, with {stored}", identity.key);
        }
    }
    Ok(())
}

impl KeyArgs {
    /// The key's identity; a malformed key, consumer or scope is bad usage.
    fn identity(self) -> Result<Identity> {
        let usage = |error: justonce_sql::Error| Usage(error.to_string());
        let scope = match self.scope {
            Some(scope) => Scope::new(scope).map_err(usage)?,
            None => Scope::none(),
        };
        let consumer = Consumer::new(self.consumer).map_err(usage)?;
        let key = Key::new(self.key).map_err(usage)?;
        Ok(Identity::new(scope, consumer, key))
    }
}

/// The key, its consumer and its scope, as an error message names them.
pub fn name(identity: &Identity) -> String {
    match identity.scope.as_str() {
        "" => format!("key {} of consumer {}", identity.key, identity.consumer),
        scope => format!(
            "key {} of consumer {} in scope {scope}",
            identity.key, identity.consumer
        ),
    }
}

async fn lookup<DB: Backend>(inbox: &Inbox<DB>, identity: &Identity) -> Result<StoredKey> {
    inbox
        .lookup(identity)
        .await?
        .with_context(|| format!("no {} is stored", name(identity)))
}

/// Prints a key whose lease is in progress, which `action` is about to change; fails for
/// one that is missing or done.
async fn show_lease_in_progress<DB: Backend>(
    inbox: &Inbox<DB>,
    identity: &Identity,
    action: &str,
) -> Result<()> {
    let stored = lookup(inbox, identity).await?;
    if stored.lease_remaining.is_none() {
        anyhow::bail!(
            "{} is done: there is no lease in progress to {action}",
            name(identity)
        );
    }
    print_key(identity, &stored);
    Ok(())
}

fn print_key(identity: &Identity, stored: &StoredKey) {
    let scope = scope_or_none(identity.scope.as_str());
    let state = match stored.lease_remaining {
        None => "done".to_owned(),
        Some(remaining) if remaining.is_zero() => "in progress, lease ended".to_owned(),
        Some(remaining) => format!("in progress, lease ends in {} s", remaining.as_secs()),
    };
    let fingerprint: String = stored
        .fingerprint
        .as_bytes()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    println!("key:         {}", identity.key);
    println!("consumer:    {}", identity.consumer);
    println!("scope:       {scope}");
    println!("state:       {state}");
    println!("fingerprint: {fingerprint}");
    match &stored.result {
        Some(result) => println!("result:      {} bytes", result.len()),
        None => println!("result:      none"),
    }
}
