/// `[state] cache_mb`: 64 unless set; 0 is refused, by name.
#[test]
fn the_sled_cache_is_64_mib_unless_set_and_never_zero() {
    let base =
        "[[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://u/\"\nlease = \"l\"\n";
    assert_eq!(Config::parse(base).unwrap().state.cache_mb, 64);
    let set = Config::parse(&format!("[state]\ncache_mb = 256\n{base}")).unwrap();
    set.validate().unwrap();
    assert_eq!(set.state.cache_mb, 256);
    let zero = Config::parse(&format!("[state]\ncache_mb = 0\n{base}")).unwrap();
    let e = zero.validate().unwrap_err();
    assert!(e.contains("[state] cache_mb must be at least 1"), "{e}");
}

#[test]
fn protection_keys_parse_and_bad_values_are_named() {
    let base =
        "[[route]]\nname = \"r\"\npath_prefix = \"/r/\"\nupstream = \"http://u/\"\nlease = \"l\"\n";
    let c = Config::parse(&format!(
        "{base}max_in_flight = 4\nhonor_retry_after = false\nmax_retry_after = \"30s\"\n[route.breaker]\nfailures = 2\ncool_down = \"1s\"\n"
    ))
    .unwrap();
    c.validate().unwrap();
    let r = &c.routes[0];
    assert_eq!(r.max_in_flight, Some(4));
    assert!(!r.honor_retry_after);
    assert_eq!(r.max_retry_after, Duration::from_secs(30));
    assert_eq!(
        r.breaker,
        Some(BreakerConfig {
            failures: 2,
            window: Duration::from_secs(10),
            cool_down: Duration::from_secs(1),
        })
    );
    let d = Config::parse(base).unwrap();
    let r = &d.routes[0];
    assert_eq!(
        (r.max_in_flight, r.honor_retry_after, r.breaker),
        (None, true, None)
    );
    assert_eq!(r.max_retry_after, Duration::from_secs(300));
    for (extra, says) in [
        ("max_in_flight = 0", "max_in_flight must be at least 1"),
        ("max_retry_after = 0", "max_retry_after must be positive"),
        (
            "breaker = { failures = 0 }",
            "breaker.failures must be at least 1",
        ),
        (
            "breaker = { cool_down = 0 }",
            "breaker.window and breaker.cool_down",
        ),
        (
            "max_retry_after = \"25h\"",
            "max_retry_after must be at most",
        ),
        (
            "breaker = { cool_down = \"300000000000y\" }",
            "breaker.window and breaker.cool_down must be at most",
        ),
        (
            "breaker = { window = \"2d\" }",
            "breaker.window and breaker.cool_down must be at most",
        ),
    ] {
        let e = Config::parse(&format!("{base}{extra}\n"))
            .and_then(|c| c.validate())
            .unwrap_err();
        assert!(
            e.contains(says) && e.contains("route \"r\""),
            "{extra}: {e}"
        );
    }
    let e = Config::parse(&format!("{base}breaker = {{ failurez = 2 }}\n")).unwrap_err();
    assert!(e.contains("failurez"), "{e}");
}
use super::*;

#[test]
fn the_rule_of_kinds_finds_a_shared_lease_or_name() {
    let k = |name, lease, queued| RouteKind {
        name,
        lease,
        queued,
    };
    assert_eq!(
        mixed_delivery([k("a", "l", true), k("b", "m", false)]),
        None
    );
    assert_eq!(
        mixed_delivery([k("a", "l", true), k("b", "l", false)]),
        Some((k("a", "l", true), k("b", "l", false))),
        "a lease's routes"
    );
    assert_eq!(
        mixed_delivery([k("b", "m", false), k("b", "l", true)]),
        Some((k("b", "l", true), k("b", "m", false))),
        "a name's history"
    );
    assert_eq!(mixed_delivery([k("a", "l", true), k("b", "l", true)]), None);
}

const MIN: &str = r#"
[[route]]
name = "billing"
path_prefix = "/billing/"
upstream = "http://127.0.0.1:1/v1/"
lease = "billing"
"#;

#[test]
fn defaults_fill_in() {
    let c = Config::parse(MIN).unwrap();
    c.validate().unwrap();
    let r = &c.routes[0];
    assert!(r.require_token);
    assert_eq!(r.dedup_header, "Idempotency-Key");
    assert_eq!(r.retryable_statuses, vec![429, 502, 503, 504]);
    assert_eq!(r.max_body_bytes, 1 << 20);
    assert_eq!(r.drain_timeout(), Duration::from_millis(10_000));
    assert_eq!(c.store.refresh_interval_ms, 1000);
    assert_eq!(c.store.grace_ms, 2000);
    assert_eq!(c.dedup.ttl, Duration::from_secs(86400));
}

#[test]
fn telemetry_is_off_unless_an_endpoint_is_set() {
    let c = Config::parse(MIN).unwrap();
    assert_eq!(c.telemetry.otlp_endpoint, None);
    assert!(c.summary().contains("traces        off"));
    let on = |extra: &str| {
        Config::parse(&format!(
            "[telemetry]\notlp_endpoint = \"http://collector:4318/\"\n{extra}\n{MIN}"
        ))
        .unwrap()
    };
    let c = on("");
    c.validate().unwrap();
    assert_eq!(c.telemetry.service_name, "fencegate");
    assert_eq!(c.telemetry.sample_ratio, 1.0);
    assert!(c
        .summary()
        .contains("OTLP/HTTP to http://collector:4318/v1/traces"));
    for (extra, says) in [
        ("sample_ratio = 1.5", "sample_ratio"),
        ("max_queue_spans = 0", "max_queue_spans"),
        ("service_name = \"\"", "service_name"),
    ] {
        let e = on(extra).validate().unwrap_err();
        assert!(e.contains(says), "{extra}: {e}");
    }
    for bad in [
        "collector:4318",
        "ftp://collector",
        "http://user:pass@collector:4318",
        "http://collector:4318/?k=v",
    ] {
        let c = Config::parse(&format!("[telemetry]\notlp_endpoint = \"{bad}\"\n{MIN}")).unwrap();
        let e = c.validate().unwrap_err();
        assert!(e.contains("otlp_endpoint"), "{bad}: {e}");
    }
    assert!(Config::parse(&format!("[telemetry]\nendpoint = \"x\"\n{MIN}")).is_err());
}

#[test]
fn a_dedup_ttl_shorter_than_a_request_can_last_is_warned_about() {
    assert!(Config::parse(MIN).unwrap().warnings().is_empty());
    let c = Config::parse(&format!("[dedup]\nttl = \"15s\"\n{MIN}")).unwrap();
    let w = c.warnings();
    assert_eq!(w.len(), 1, "{w:?}");
    assert!(
        w[0].contains("\"billing\"") && w[0].contains("20s"),
        "{}",
        w[0]
    );
}

#[test]
fn durations_take_either_form_under_either_name() {
    let c = Config::parse(&format!(
        "[server]\nshutdown_timeout = \"3s\"\nheader_read_timeout_ms = 1500\nshutdown_delay = \"5s\"\n\
         [store]\ngrace_ms = \"2500ms\"\nrefresh_interval = 250\ngate_ttl = 12000\n\
         [dedup]\nttl = \"1h\"\n{MIN}timeout = \"4s\"\ndrain_timeout = \"1s\"\n"
    ))
    .unwrap();
    assert_eq!(c.server.shutdown_timeout_ms, 3000);
    assert_eq!(c.server.header_read_timeout_ms, 1500);
    assert_eq!(c.server.shutdown_delay_ms, 5000);
    assert_eq!(Config::parse(MIN).unwrap().server.shutdown_delay_ms, 0);
    assert_eq!(c.store.grace_ms, 2500);
    assert_eq!(c.store.refresh_interval_ms, 250);
    assert_eq!(c.store.gate_ttl, Duration::from_secs(12));
    assert_eq!(c.dedup.ttl, Duration::from_secs(3600));
    assert_eq!(c.routes[0].timeout_ms, 4000);
    assert_eq!(c.routes[0].drain_timeout(), Duration::from_secs(1));
    let e = Config::parse(&format!("{MIN}timeout = \"soon\"\n")).unwrap_err();
    assert!(e.contains("soon"), "{e}");
    let e = Config::parse(&format!("{MIN}timeout = 1\ntimeout_ms = 2\n")).unwrap_err();
    assert!(e.contains("duplicate"), "{e}");
}

#[test]
fn listen_takes_a_host_name() {
    let c = Config::parse(&format!("[server]\nlisten = \"localhost:8085\"\n{MIN}")).unwrap();
    assert_eq!(c.server.listen, SocketAddr::from(([127, 0, 0, 1], 8085)));
    assert!(Config::parse(&format!("[server]\nlisten = \"localhost\"\n{MIN}")).is_err());
}

#[test]
fn listen_and_admin_listen_must_differ() {
    for (l, a) in [
        ("127.0.0.1:8080", "127.0.0.1:8080"),
        ("0.0.0.0:8080", "127.0.0.1:8080"),
    ] {
        let c = Config::parse(&format!(
            "[server]\nlisten = \"{l}\"\nadmin_listen = \"{a}\"\n{MIN}"
        ))
        .unwrap();
        let e = c.validate().unwrap_err();
        assert!(e.contains("admin_listen"), "{e}");
    }
    let c = Config::parse(&format!(
        "[server]\nlisten = \"127.0.0.1:0\"\nadmin_listen = \"127.0.0.1:0\"\n{MIN}"
    ))
    .unwrap();
    c.validate().unwrap();
}

#[test]
fn relative_paths_follow_the_config_file() {
    let mut c = Config::parse(&format!(
        "[server]\ndata_dir = \"state\"\n[store]\npath = \"/abs/leases\"\n{MIN}"
    ))
    .unwrap();
    c.resolve_paths(Path::new("/etc/fencegate/fencegate.toml"));
    assert_eq!(c.server.data_dir, Path::new("/etc/fencegate/state"));
    assert_eq!(c.store.path, Path::new("/abs/leases"));
}

#[test]
fn a_typo_gets_a_did_you_mean() {
    let e = Config::parse("[server]\nlisten = \"127.0.0.1:1\"\nlistne = 1\n").unwrap_err();
    assert!(
        e.starts_with("line 3: unknown field `listne` — did you mean `listen`? (expected one of"),
        "{e}"
    );
    let e = Config::parse("[server]\nshutdown_timeout = \"ten seconds\"\n").unwrap_err();
    assert!(
        e.starts_with("line 2, shutdown_timeout: \"ten seconds\" is not a duration"),
        "names the key: {e}"
    );
    let e = Config::parse(&format!("{MIN}drain_timout_ms = 5\n")).unwrap_err();
    assert!(e.contains("did you mean `drain_timeout_ms`?"), "{e}");
    let e = Config::parse(&format!("[sever]\n{MIN}")).unwrap_err();
    assert!(e.contains("did you mean `server`?"), "{e}");
    let e = Config::parse(&format!("{MIN}derive_key = \"contnet\"\n")).unwrap_err();
    assert!(e.contains("did you mean `content`?"), "{e}");
    // Nothing close: no guess.
    let e = Config::parse(&format!("{MIN}colour = 5\n")).unwrap_err();
    assert!(
        e.contains("unknown field `colour`") && !e.contains("did you mean"),
        "{e}"
    );
}

#[test]
fn unknown_keys_are_named() {
    let e = Config::parse(&format!("{MIN}\ntimeout_msec = 5\n")).unwrap_err();
    assert!(e.contains("timeout_msec"), "{e}");
    let e = Config::parse("[server]\nlisten = \"127.0.0.1:1\"\nlistne = 1\n").unwrap_err();
    assert!(e.contains("listne"), "{e}");
}

#[test]
fn validation_catches_cross_field_errors() {
    let bad = [
        (MIN.replace("\"billing\"\npath", "\"Bad Name\"\npath"), "route name"),
        (MIN.replace("/billing/", "billing"), "path_prefix"),
        (MIN.replace("http://127.0.0.1:1/v1/", "ftp://x/"), "http://"),
        (format!("[store]\nkind = \"s3\"\n{MIN}"), "bucket"),
        (format!("{MIN}\n[[route]]\nname=\"b\"\npath_prefix=\"/billing/\"\nupstream=\"http://x/\"\nlease=\"b\"\n"), "two routes"),
        (format!("{MIN}upstream_headers = {{ Authorization = \"${{FENCEGATE_SURELY_UNSET_VAR}}\" }}\n"), "FENCEGATE_SURELY_UNSET_VAR"),
    ];
    for (text, needle) in bad {
        let err = Config::parse(&text).and_then(|c| c.validate()).unwrap_err();
        assert!(err.contains(needle), "{needle}: {err}");
    }
}

/// Issue 29: `signing_secrets` and `client_cert`/`client_key` — paths follow
/// the config file, and the cross-key rules are named.
#[test]
fn signing_and_client_certificate_keys_are_checked() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    let mut c = Config::parse(&format!(
        "{MIN}client_cert = \"certs/c.pem\"\nclient_key = \"/abs/c.key\"\n"
    ))
    .unwrap();
    c.resolve_paths(Path::new("/etc/fencegate/fencegate.toml"));
    assert_eq!(
        c.routes[0].client_cert.as_deref(),
        Some(Path::new("/etc/fencegate/certs/c.pem"))
    );
    assert_eq!(
        c.routes[0].client_key.as_deref(),
        Some(Path::new("/abs/c.key"))
    );
    let c = Config::parse(&format!("{MIN}signing_secrets = [\"{secret}\"]\n")).unwrap();
    c.validate().unwrap();
    assert!(c.routes[0].signer().unwrap().is_some());
    assert!(!format!("{:?}", c.routes[0]).contains(&secret[6..]));
    let bad = [
        (
            format!("{MIN}signing_secrets = [\"{secret}\"]\nupstream_headers = {{ Webhook-Signature = \"x\" }}\n"),
            "upstream_headers sets Webhook-Signature",
        ),
        (format!("{MIN}client_key = \"k.pem\"\n"), "set both or neither"),
    ];
    for (text, needle) in bad {
        let err = Config::parse(&text).and_then(|c| c.validate()).unwrap_err();
        assert!(err.contains(needle), "{needle}: {err}");
    }
    // A client certificate on a plain-http upstream is refused (files valid).
    let dir = tempfile::tempdir().unwrap();
    let ck = rcgen::generate_simple_self_signed(vec!["c.test".into()]).unwrap();
    std::fs::write(dir.path().join("c.pem"), ck.cert.pem()).unwrap();
    std::fs::write(dir.path().join("c.key"), ck.signing_key.serialize_pem()).unwrap();
    let mut c = Config::parse(&format!(
        "{MIN}client_cert = \"c.pem\"\nclient_key = \"c.key\"\n"
    ))
    .unwrap();
    c.resolve_paths(&dir.path().join("fencegate.toml"));
    let err = c.validate().unwrap_err();
    assert!(err.contains("needs an https:// upstream"), "{err}");
}

/// `signing_secrets` of any other type than a list of strings is refused
/// without its value in the error (the error is logged and printed).
#[test]
fn signing_secrets_of_the_wrong_type_are_refused_unquoted() {
    let secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
    for value in [
        format!("\"{secret}\""),
        "4242424242".to_owned(),
        "true".to_owned(),
        format!("{{ s = \"{secret}\" }}"),
        format!("[\"{secret}\", 4242424242]"),
    ] {
        let err = Config::parse(&format!("{MIN}signing_secrets = {value}\n")).unwrap_err();
        assert!(err.contains("secret"), "{value}: {err}");
        assert!(!err.contains(&secret[6..]), "{value}: {err}");
    }
}

/// `[state] schema` (SPEC §9): an unquoted identifier, PostgreSQL only;
/// each wrong value refused with the rule it breaks.
#[test]
fn the_state_schema_is_an_identifier_of_postgres() {
    let pg = |schema: &str| {
        format!("[state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\nschema = \"{schema}\"\n{MIN}")
    };
    for good in ["fg_staging", "_x", "prod2", &"a".repeat(63)] {
        let c = Config::parse(&pg(good)).unwrap();
        c.validate().unwrap();
        assert_eq!(c.state.schema.as_deref(), Some(good));
    }
    let long = "a".repeat(64);
    for (bad, needle) in [
        ("", "lowercase letters"),
        ("Staging", "lowercase letters"),
        ("2fg", "not starting with a digit"),
        ("fg-staging", "lowercase letters"),
        ("fg staging", "lowercase letters"),
        ("fg\\\"; DROP", "lowercase letters"),
        (long.as_str(), "63"),
        ("pg_fg", "reserved"),
    ] {
        let err = Config::parse(&pg(bad))
            .and_then(|c| c.validate())
            .unwrap_err();
        assert!(err.contains(needle), "{bad:?}: {err}");
    }
    let sled = format!("[state]\nschema = \"fg\"\n{MIN}");
    let err = Config::parse(&sled).and_then(|c| c.validate()).unwrap_err();
    assert!(err.contains("kind is \"sled\""), "{err}");
}

/// `[cluster]` (SPEC §10.2): its rules, each named in the error.
#[test]
fn cluster_keys_are_checked() {
    let pg = "[state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\n";
    let cluster = |body: &str| format!("{pg}[cluster]\n{body}\n{MIN}");
    let good = "instance_id = \"fg-a\"\nadvertise = \"http://10.0.0.1:8080\"\npeer_token = \"0123456789abcdef\"";
    let c = Config::parse(&cluster(good)).unwrap();
    c.validate().unwrap();
    assert_eq!(c.cluster.as_ref().map(|c| c.shards), Some(16));
    let bad = [
        (format!("[cluster]\n{good}\n{MIN}"), "kind = \"postgres\""),
        (cluster(&good.replace("fg-a", "fg a")), "instance_id"),
        (
            cluster(&good.replace("http://10.0.0.1:8080", "10.0.0.1:8080")),
            "advertise",
        ),
        (cluster(&format!("{good}\nshards = 0")), "shards"),
        (
            cluster(&good.replace("0123456789abcdef", "short")),
            "peer_token",
        ),
        (
            cluster(&good.replace("0123456789abcdef", "${FENCEGATE_SURELY_UNSET_VAR}")),
            "FENCEGATE_SURELY_UNSET_VAR",
        ),
    ];
    for (text, needle) in bad {
        let err = Config::parse(&text).and_then(|c| c.validate()).unwrap_err();
        assert!(err.contains(needle), "{needle}: {err}");
    }
    let e = Config::parse(&cluster(&format!("{good}\nshard = 4"))).unwrap_err();
    assert!(e.contains("shard"), "{e}");
}

/// One file for every member of a Kubernetes Deployment: `instance_id` and
/// `advertise` may name environment variables (the pod's name, its IP).
#[test]
fn cluster_id_and_advertise_may_come_from_the_environment() {
    std::env::set_var("FENCEGATE_CONFIG_TEST_POD", "fencegate-7d9f-x2x");
    std::env::set_var("FENCEGATE_CONFIG_TEST_ADV", "http://10.1.2.3:8080");
    let text = "[state]\nkind = \"postgres\"\nurl = \"postgres://fg@127.0.0.1/fg\"\n\
                [cluster]\ninstance_id = \"${FENCEGATE_CONFIG_TEST_POD}\"\n\
                advertise = \"${FENCEGATE_CONFIG_TEST_ADV}\"\npeer_token = \"0123456789abcdef\"\n";
    let mut c = Config::parse(&format!("{text}{MIN}")).unwrap();
    c.resolve_env().unwrap();
    c.validate().unwrap();
    let k = c.cluster.unwrap();
    assert_eq!(
        (k.instance_id.as_str(), k.advertise.as_str()),
        ("fencegate-7d9f-x2x", "http://10.1.2.3:8080")
    );
    let mut c = Config::parse(&format!(
        "{}{MIN}",
        text.replace("FENCEGATE_CONFIG_TEST_ADV", "FENCEGATE_SURELY_UNSET_VAR")
    ))
    .unwrap();
    let e = c.resolve_env().unwrap_err();
    assert!(
        e.contains("[cluster] advertise reads ${FENCEGATE_SURELY_UNSET_VAR}"),
        "{e}"
    );
}
