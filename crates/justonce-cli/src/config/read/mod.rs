//! Reading: the file and the variables into the raw document, each value with where it came
//! from. A value is judged here only by its TOML type; validation judges the rest.

mod document;
mod env;
mod origin;
mod print;
mod raw;
mod toml_text;

pub use env::{Env, OTLP_ENDPOINT_VARIABLE, OTLP_TRACES_ENDPOINT_VARIABLE, process_env};
pub use origin::Origin;
pub use raw::{Count, RawConfig, RawConsumer, RawSource};
pub use toml_text::{quoted, redacted};

use anyhow::{Context, Result};
use origin::named_file;
use serde::Deserialize;
use std::cell::RefCell;
use toml::de::DeTable;

/// The file and the variables, read.
pub struct Reading<'i> {
    pub raw: RawConfig,
    /// Where each value came from.
    pub origin: Origin<'i>,
    /// `JUSTONCE_*` variables that name no setting.
    pub unknown_variables: Vec<String>,
}

/// Reads the text of `file`, `None` when there is no such file, with the variables of `env`
/// applied. A syntax error shows its line and column; any other names its setting.
pub fn read<'i>(text: Option<&'i str>, file: &'i str, env: &Env) -> Result<Reading<'i>> {
    let found = text.is_some();
    let named = || named_file(file, found);
    let text = text.unwrap_or_default();
    let mut document = DeTable::parse(text).with_context(|| format!("{file} is not valid TOML"))?;
    let applied = env::apply_env(document.get_mut(), env, text.len()).with_context(named)?;
    let origin = Origin {
        file,
        found,
        text,
        document: document.get_ref().clone(),
        overrides: applied.overrides,
        defaults: RefCell::default(),
    };
    let raw = RawConfig::deserialize(toml::de::Deserializer::from(document))
        .map_err(|error| origin.explain(&error))
        .with_context(named)?;
    Ok(Reading {
        raw,
        origin,
        unknown_variables: applied.unknown,
    })
}
