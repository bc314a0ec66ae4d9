//! Where `serve` sends its traces.

use crate::config::read::{Env, OTLP_ENDPOINT_VARIABLE, OTLP_TRACES_ENDPOINT_VARIABLE, Origin};
use anyhow::{Result, bail, ensure};

/// Where `serve` posts its spans: `<server.otlp_endpoint>/v1/traces` (the setting, which
/// `OTEL_EXPORTER_OTLP_ENDPOINT` sets when nothing else does), else the standard
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` as it is; `None` when neither is set. A protocol
/// that a variable names must be `http/protobuf`: the only one this build speaks.
pub fn traces_url(setting: Option<&str>, env: &Env, origin: &Origin<'_>) -> Result<Option<String>> {
    let set = |name: &str| env.get(name).filter(|value| !value.trim().is_empty());
    let (url, named) = if let Some(base) = setting {
        let url = format!("{}/v1/traces", base.trim_end_matches('/'));
        (url, origin.name(&["server", "otlp_endpoint"]))
    } else if let Some(url) = set(OTLP_TRACES_ENDPOINT_VARIABLE) {
        (url.clone(), OTLP_TRACES_ENDPOINT_VARIABLE.to_owned())
    } else {
        return Ok(None);
    };
    if !cfg!(feature = "otlp") {
        // The standard variables may be meant for other programs: only the setting is
        // refused.
        let by_standard_variable =
            origin.set_by(&["server", "otlp_endpoint"]) == Some(OTLP_ENDPOINT_VARIABLE);
        ensure!(
            setting.is_none() || by_standard_variable,
            "{named}: this build of justonce exports no traces (built without the `otlp` feature)"
        );
        return Ok(None);
    }
    let parsed = reqwest::Url::parse(&url).ok();
    if !parsed.is_some_and(|url| matches!(url.scheme(), "http" | "https") && url.has_host()) {
        bail!("{named}: must be an http:// or https:// URL");
    }
    for variable in [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ] {
        if let Some(protocol) = set(variable) {
            ensure!(
                protocol.trim() == "http/protobuf",
                "{variable}: {protocol:?} is not supported: justonce exports traces over \
                 \"http/protobuf\""
            );
            break;
        }
    }
    Ok(Some(url))
}

#[cfg(test)]
mod tests {
    use crate::config::testing::{SHOP, assert_named, env_of, load_text};

    #[test]
    fn traces_go_to_the_setting_else_to_the_standard_variables() {
        let traces = |text: &str, pairs: &[(&str, &str)]| {
            let env = env_of(&[&[("SHOP_SECRET", "whsec_c2VjcmV0")], pairs].concat());
            load_text(text, &env).unwrap().traces_url
        };
        assert_eq!(traces(SHOP, &[]), None);
        let general = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/");
        let signal = (
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://collector:4318/traces",
        );
        let expected = |url: &str| Some(url.to_owned());
        assert_eq!(
            traces(SHOP, &[general]),
            expected("http://collector:4318/v1/traces")
        );
        assert_eq!(
            traces(SHOP, &[general, signal]),
            expected("http://collector:4318/traces")
        );
        let file = SHOP.replacen(
            "body_limit",
            "otlp_endpoint = \"https://traces.internal\"\nbody_limit",
            1,
        );
        assert_eq!(
            traces(&file, &[general, signal]),
            expected("https://traces.internal/v1/traces")
        );
        let variable = ("JUSTONCE_SERVER_OTLP_ENDPOINT", "http://127.0.0.1:4318");
        assert_eq!(
            traces(&file, &[variable]),
            expected("http://127.0.0.1:4318/v1/traces")
        );
        // An empty standard variable is as good as unset.
        assert_eq!(traces(SHOP, &[("OTEL_EXPORTER_OTLP_ENDPOINT", "")]), None);

        let env = env_of(&[("SHOP_SECRET", "whsec_c2VjcmV0"), general]);
        let printed = load_text(SHOP, &env).unwrap().printed;
        let line = "otlp_endpoint = \"http://collector:4318/\"  # from OTEL_EXPORTER_OTLP_ENDPOINT";
        assert!(printed.contains(line), "{printed}");
    }

    #[test]
    fn an_unusable_traces_endpoint_or_protocol_is_refused_by_name() {
        let secret = ("SHOP_SECRET", "whsec_c2VjcmV0");
        let general = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318");
        let file = SHOP.replacen(
            "body_limit",
            "otlp_endpoint = \"collector:4318\"\nbody_limit",
            1,
        );
        assert_named(
            &file,
            &env_of(&[secret]),
            "server.otlp_endpoint (line 4)",
            "must be an http:// or https:// URL",
        );
        assert_named(
            SHOP,
            &env_of(&[secret, ("OTEL_EXPORTER_OTLP_ENDPOINT", "grpc://x:4317")]),
            "server.otlp_endpoint (from OTEL_EXPORTER_OTLP_ENDPOINT)",
            "must be an http:// or https:// URL",
        );
        for (variable, protocol) in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ] {
            assert_named(
                SHOP,
                &env_of(&[secret, general, (variable, protocol)]),
                variable,
                "is not supported: justonce exports traces over \"http/protobuf\"",
            );
        }
        // The signal's own protocol comes before the general one.
        let env = env_of(&[
            secret,
            general,
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf"),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
        ]);
        assert!(load_text(SHOP, &env).unwrap().traces_url.is_some());
        // Without an endpoint nothing is exported, and the protocol does not matter.
        let env = env_of(&[secret, ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")]);
        assert_eq!(load_text(SHOP, &env).unwrap().traces_url, None);
    }
}
