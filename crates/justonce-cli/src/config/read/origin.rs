//! Where each value came from: a line of the file, a variable, or a default. Every error
//! names its setting by it.

use super::document::{path_at, span_of};
use super::env::variable_of;
use super::toml_text::quoted;
use anyhow::anyhow;
use std::cell::RefCell;
use std::collections::BTreeMap;
use toml::de::DeTable;

/// Where each setting came from: the parsed file, for its lines, the variables that set
/// settings or declared sources and consumers, and the defaults validation used.
pub struct Origin<'i> {
    pub(super) file: &'i str,
    pub(super) found: bool,
    pub(super) text: &'i str,
    /// The file with the variables applied.
    pub(super) document: DeTable<'i>,
    /// The variable that set each setting, or declared each source or consumer.
    pub(super) overrides: BTreeMap<Vec<String>, String>,
    /// The defaults validation used, as TOML values, for `justonce config`.
    pub(super) defaults: RefCell<BTreeMap<Vec<String>, String>>,
}

impl Origin<'_> {
    /// `sources.shop.retention (line 12)`, `... (from JUSTONCE_SOURCES_SHOP_RETENTION)`, or
    /// the bare key for a default. A source or consumer declared by variables takes its
    /// missing settings from variables too: those are named with theirs.
    pub fn name(&self, path: &[&str]) -> String {
        let key = path.join(".");
        let owned: Vec<String> = path.iter().map(|part| (*part).to_owned()).collect();
        if let Some(variable) = self.overrides.get(&owned) {
            return format!("{key} (from {variable})");
        }
        if let Some(span) = span_of(&self.document, &owned) {
            return format!("{key} (line {})", self.line(span.start));
        }
        if path.len() == 3 && self.overrides.contains_key(&owned[..2]) {
            return format!("{key} ({})", variable_of(path));
        }
        key
    }

    /// The line of the file at byte `offset`.
    pub(super) fn line(&self, offset: usize) -> usize {
        let offset = offset.min(self.text.len());
        self.text.as_bytes()[..offset]
            .iter()
            .filter(|byte| **byte == b'\n')
            .count()
            + 1
    }

    /// A deserialization error, named by the setting at its position.
    pub fn explain(&self, error: &toml::de::Error) -> anyhow::Error {
        let mut path = error
            .span()
            .map(|span| path_at(&self.document, span.start))
            .unwrap_or_default();
        let mut message = error.message().to_owned();
        // serde words a missing field `missing field `NAME``: name it by its own key.
        if let Some(field) = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.strip_suffix('`'))
        {
            path.push(field.to_owned());
            message = "is required".to_owned();
        }
        if path.is_empty() {
            return anyhow!("{message}");
        }
        let path: Vec<&str> = path.iter().map(String::as_str).collect();
        anyhow!("{}: {message}", self.name(&path))
    }

    /// `value`, or else `default`, which `justonce config` then shows as the value of `path`.
    pub fn or_default<'v>(
        &self,
        path: &[&str],
        value: Option<&'v str>,
        default: &'v str,
    ) -> &'v str {
        value.unwrap_or_else(|| {
            self.defaulted(path, quoted(default));
            default
        })
    }

    /// Records that `path` took its default, `value` as TOML.
    pub fn defaulted(&self, path: &[&str], value: String) {
        let path = path.iter().map(|part| (*part).to_owned()).collect();
        self.defaults.borrow_mut().insert(path, value);
    }

    /// The file as errors and `justonce config` name it.
    pub fn named_file(&self) -> String {
        named_file(self.file, self.found)
    }

    /// The variable that set the setting at `path`, if one did.
    pub fn set_by(&self, path: &[&str]) -> Option<&str> {
        let path: Vec<String> = path.iter().map(|part| (*part).to_owned()).collect();
        self.overrides.get(&path).map(String::as_str)
    }
}

/// `file`, or `file (not found)` when there is no such file.
pub fn named_file(file: &str, found: bool) -> String {
    if found {
        file.to_owned()
    } else {
        format!("{file} (not found)")
    }
}
