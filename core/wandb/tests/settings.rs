//! `WandbSettings::from_lookup`/`from_env`: no key means no sink, the `WANDB_*` variables, the
//! `[wandb]` TOML section winning over them, the disabling switches, and refused values.

use std::collections::HashMap;
use std::time::Duration;

use rlhf_wandb::{WandbConfig, WandbSettings, DEFAULT_BASE_URL, DEFAULT_PROJECT};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    move |name| map.get(name).cloned()
}

fn section(toml_text: &str) -> WandbConfig {
    #[derive(serde::Deserialize)]
    struct File {
        wandb: WandbConfig,
    }
    toml::from_str::<File>(toml_text).unwrap().wandb
}

#[test]
fn no_api_key_means_no_sink() {
    let none = WandbSettings::from_lookup(&WandbConfig::default(), env(&[])).unwrap();
    assert!(none.is_none());
    // Other settings without a key: still none, and not an error.
    let config = WandbConfig { enabled: Some(true), project: Some("p".into()), ..Default::default() };
    let none = WandbSettings::from_lookup(&config, env(&[("WANDB_PROJECT", "q"), ("WANDB_API_KEY", "  ")])).unwrap();
    assert!(none.is_none());
}

#[test]
fn environment_variables() {
    let s = WandbSettings::from_lookup(
        &WandbConfig::default(),
        env(&[
            ("WANDB_API_KEY", "k123"),
            ("WANDB_BASE_URL", "http://localhost:8080/"),
            ("WANDB_PROJECT", "rlhf"),
            ("WANDB_ENTITY", "team"),
            ("WANDB_RUN_ID", "run42"),
            ("WANDB_NAME", "first try"),
            ("WANDB_RUN_GROUP", "g"),
            ("WANDB_TAGS", "a, b,,c"),
        ]),
    )
    .unwrap()
    .unwrap();
    assert_eq!(s.api_key, "k123");
    assert_eq!(s.base_url, "http://localhost:8080");
    assert_eq!(s.project, "rlhf");
    assert_eq!(s.entity.as_deref(), Some("team"));
    assert_eq!(s.run_id.as_deref(), Some("run42"));
    assert_eq!(s.run_name.as_deref(), Some("first try"));
    assert_eq!(s.group.as_deref(), Some("g"));
    assert_eq!(s.tags, ["a", "b", "c"]);
    assert!(!format!("{s:?}").contains("k123"), "the key is redacted from Debug");

    let defaults =
        WandbSettings::from_lookup(&WandbConfig::default(), env(&[("WANDB_API_KEY", "k")])).unwrap().unwrap();
    assert_eq!(defaults.base_url, DEFAULT_BASE_URL);
    assert_eq!(defaults.project, DEFAULT_PROJECT);
    assert_eq!((defaults.entity, defaults.run_id, defaults.run_name), (None, None, None));
    assert_eq!(defaults.flush_interval, Duration::from_secs(2));
    assert_eq!(defaults.max_retries, 5);
    assert_eq!(defaults.request_timeout, Duration::from_secs(10));
}

#[test]
fn the_config_section_wins_over_the_environment() {
    let config = section(
        r#"
        [wandb]
        project = "from-config"
        entity = "cfg-team"
        base_url = "http://wandb.internal:8080"
        run_name = "named"
        run_id = "cfgid001"
        tags = ["x"]
        flush_interval_s = 0.5
        max_retries = 2
        finish_timeout_s = 7
        "#,
    );
    let s = WandbSettings::from_lookup(
        &config,
        env(&[
            ("WANDB_API_KEY", "k"),
            ("WANDB_PROJECT", "from-env"),
            ("WANDB_ENTITY", "env-team"),
            ("WANDB_BASE_URL", "http://elsewhere"),
            ("WANDB_NAME", "env-name"),
            ("WANDB_RUN_ID", "envid"),
            ("WANDB_TAGS", "y"),
        ]),
    )
    .unwrap()
    .unwrap();
    assert_eq!(s.project, "from-config");
    assert_eq!(s.entity.as_deref(), Some("cfg-team"));
    assert_eq!(s.base_url, "http://wandb.internal:8080");
    assert_eq!(s.run_name.as_deref(), Some("named"));
    assert_eq!(s.run_id.as_deref(), Some("cfgid001"));
    assert_eq!(s.tags, ["x"]);
    assert_eq!(s.flush_interval, Duration::from_millis(500));
    assert_eq!(s.max_retries, 2);
    assert_eq!(s.finish_timeout, Duration::from_secs(7));
}

#[test]
fn switches_that_disable_the_sink() {
    let key = ("WANDB_API_KEY", "k");
    let disabled = section("[wandb]\nenabled = false\n");
    assert!(WandbSettings::from_lookup(&disabled, env(&[key])).unwrap().is_none());
    for mode in ["disabled", "offline", "dryrun"] {
        let s = WandbSettings::from_lookup(&WandbConfig::default(), env(&[key, ("WANDB_MODE", mode)])).unwrap();
        assert!(s.is_none(), "WANDB_MODE={mode}");
    }
    assert!(WandbSettings::from_lookup(&WandbConfig::default(), env(&[key, ("WANDB_DISABLED", "true")]))
        .unwrap()
        .is_none());
    assert!(WandbSettings::from_lookup(&WandbConfig::default(), env(&[key, ("WANDB_MODE", "online")]))
        .unwrap()
        .is_some());
}

#[test]
fn the_key_can_come_from_netrc() {
    let dir = std::env::temp_dir().join(format!("rlhf-wandb-netrc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("netrc");
    std::fs::write(&path, "machine api.wandb.ai\n  login user\n  password netrc-key\n").unwrap();
    let path = path.to_str().unwrap().to_string();
    let s = WandbSettings::from_lookup(&WandbConfig::default(), env(&[("NETRC", &path)])).unwrap().unwrap();
    assert_eq!(s.api_key, "netrc-key");
    // The entry is per host: another base URL finds no key.
    let other = WandbSettings::from_lookup(
        &WandbConfig::default(),
        env(&[("NETRC", &path), ("WANDB_BASE_URL", "http://localhost:8080")]),
    )
    .unwrap();
    assert!(other.is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn unusable_values_are_errors() {
    let key = ("WANDB_API_KEY", "k");
    let bad = |config: WandbConfig, extra: &[(&str, &str)]| {
        let mut pairs = vec![key];
        pairs.extend_from_slice(extra);
        WandbSettings::from_lookup(&config, env(&pairs)).unwrap_err().to_string()
    };
    assert!(bad(WandbConfig::default(), &[("WANDB_BASE_URL", "ftp://x")]).contains("base_url"));
    assert!(bad(WandbConfig { flush_interval_s: Some(-1.0), ..Default::default() }, &[]).contains("flush_interval_s"));
    assert!(bad(WandbConfig { run_id: Some("a/b".into()), ..Default::default() }, &[]).contains("run_id"));
    assert!(bad(WandbConfig::default(), &[("WANDB_PROJECT", "has space")]).contains("project"));

    let unknown = toml::from_str::<WandbConfig>("projct = \"typo\"").unwrap_err().to_string();
    assert!(unknown.contains("projct"), "{unknown}");
}
