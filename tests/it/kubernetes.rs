//! `deploy/kubernetes` (issue 30 §2) agrees with the code. Schema validation of
//! every manifest is `scripts/k8s-validate.sh` (kubernetes-validate, offline);
//! here each overlay is read as Kubernetes would read it (YAML through PyYAML)
//! and checked against what the binary does: its config passes `fencegate
//! check-config` with the environment the pod gives it, its probes name
//! endpoints that answer, the grace period covers the shutdown, ports, users,
//! volumes and selectors line up.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use bytes::Bytes;
use http::Request;
use http_body_util::Full;
use serde_json::Value;

use crate::support::*;

fn deploy_dir() -> PathBuf {
    repo_root().join("deploy/kubernetes")
}

/// Every document of a YAML file, as JSON (PyYAML's safe loader: what
/// `kubectl` accepts, without a YAML crate here).
fn yaml_docs(path: &Path) -> Vec<Value> {
    let script = "import sys, json, yaml\n\
                  print(json.dumps([d for d in yaml.safe_load_all(open(sys.argv[1])) if d is not None]))";
    let out = Command::new(test_python())
        .args(["-c", script])
        .arg(path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} does not parse as YAML: {}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// One overlay: its kustomization's resources, read in order.
struct Overlay {
    name: &'static str,
    objects: Vec<Value>,
}

impl Overlay {
    fn load(name: &'static str) -> Overlay {
        let dir = deploy_dir().join(name);
        let kustomization = &yaml_docs(&dir.join("kustomization.yaml"))[0];
        let listed: Vec<String> = kustomization["resources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.as_str().unwrap().to_owned())
            .collect();
        // No manifest in the folder is left out of the kustomization.
        let present: BTreeSet<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|f| f.ends_with(".yaml") && f != "kustomization.yaml")
            .collect();
        assert_eq!(
            listed.iter().cloned().collect::<BTreeSet<_>>(),
            present,
            "{name}: kustomization.yaml's resources"
        );
        let objects = listed
            .iter()
            .flat_map(|f| yaml_docs(&dir.join(f)))
            .collect();
        Overlay { name, objects }
    }

    fn all(&self, kind: &str) -> Vec<&Value> {
        self.objects.iter().filter(|o| o["kind"] == kind).collect()
    }

    fn one(&self, kind: &str) -> &Value {
        let found = self.all(kind);
        assert_eq!(found.len(), 1, "{}: one {kind}", self.name);
        found[0]
    }

    fn workload(&self) -> &Value {
        let w: Vec<&Value> = self
            .objects
            .iter()
            .filter(|o| o["kind"] == "StatefulSet" || o["kind"] == "Deployment")
            .collect();
        assert_eq!(w.len(), 1, "{}: one workload", self.name);
        w[0]
    }

    fn pod(&self) -> &Value {
        &self.workload()["spec"]["template"]["spec"]
    }

    fn container(&self) -> &Value {
        let c = self.pod()["containers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["name"] == "fencegate")
            .expect("a container named fencegate");
        c
    }

    fn config_text(&self) -> String {
        self.one("ConfigMap")["data"]["fencegate.toml"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    /// The container's environment as the kubelet would set it, with stand-ins
    /// for what only a running pod has (its name and IP) and the Secret's values.
    fn env(&self) -> BTreeMap<String, String> {
        let secrets: BTreeMap<String, &Value> = self
            .all("Secret")
            .into_iter()
            .map(|s| (s["metadata"]["name"].as_str().unwrap().to_owned(), s))
            .collect();
        let mut env: BTreeMap<String, String> = BTreeMap::new();
        for e in self.container()["env"].as_array().unwrap() {
            let name = e["name"].as_str().unwrap().to_owned();
            let value = if let Some(v) = e["value"].as_str() {
                // `$(VAR)` refers to a variable defined earlier.
                let mut v = v.to_owned();
                for (k, val) in &env {
                    v = v.replace(&format!("$({k})"), val);
                }
                assert!(!v.contains("$("), "{name}: {v} names an undefined variable");
                v
            } else if let Some(field) = e["valueFrom"]["fieldRef"]["fieldPath"].as_str() {
                match field {
                    "metadata.name" => format!("{}-7d9f8b6c5-x2x4q", self.name),
                    "status.podIP" => "10.244.1.17".to_owned(),
                    other => panic!("{name}: unexpected fieldRef {other}"),
                }
            } else {
                let r = &e["valueFrom"]["secretKeyRef"];
                let (secret, key) = (r["name"].as_str().unwrap(), r["key"].as_str().unwrap());
                let from = secrets
                    .get(secret)
                    .and_then(|s| s["stringData"][key].as_str());
                match from {
                    Some(v) => v.to_owned(),
                    None if r["optional"] == true => continue,
                    None => panic!("{name}: Secret {secret} has no key {key}"),
                }
            };
            env.insert(name, value);
        }
        env
    }
}

fn seconds(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// Each overlay's config passes `fencegate check-config` in the pod's
/// environment (every `${NAME}` it reads is set by the pod spec), the container's
/// arguments parse and name the mounted config, ports and probes line up, the
/// grace period covers the shutdown delay, the drain and the release, and the
/// pod runs as the image's non-root user on a read-only root.
#[test]
fn each_overlay_agrees_with_the_binary_and_the_image() {
    skip_without_python!();
    let dockerfile = std::fs::read_to_string(repo_root().join("Dockerfile")).unwrap();
    let image_user = dockerfile
        .rsplit("FROM ")
        .next()
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("USER "))
        .unwrap()
        .trim()
        .to_owned();
    let (image_uid, image_gid) = image_user.split_once(':').unwrap();
    for name in ["single", "cluster"] {
        let o = Overlay::load(name);
        let text = o.config_text();
        let c = o.container();
        let env = o.env();

        // The config file, where the pod mounts it, in the pod's environment.
        let args: Vec<String> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| a.as_str().unwrap().to_owned())
            .collect();
        let cfg_path = &args[args.iter().position(|a| a == "--config").unwrap() + 1];
        let mount = c["volumeMounts"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| {
                Path::new(cfg_path).parent() == Some(Path::new(m["mountPath"].as_str().unwrap()))
            })
            .unwrap_or_else(|| panic!("{name}: nothing mounted at {cfg_path}'s folder"));
        let volume = o.pod()["volumes"]
            .as_array()
            .unwrap()
            .iter()
            .find(|v| v["name"] == mount["name"])
            .unwrap();
        assert_eq!(
            volume["configMap"]["name"],
            o.one("ConfigMap")["metadata"]["name"],
            "{name}: the config comes from the ConfigMap"
        );
        assert_eq!(Path::new(cfg_path).file_name().unwrap(), "fencegate.toml");
        let mut help_args = args.clone();
        help_args.push("--help".into());
        let help = Command::new(bin()).args(&help_args).output().unwrap();
        assert!(help.status.success(), "{name}: args {args:?} do not parse");
        assert!(
            args.windows(2).any(|w| w == ["--log-format", "json"]),
            "{name}: JSON logs"
        );

        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("fencegate.toml");
        std::fs::write(&file, &text).unwrap();
        let reads = text
            .split("${")
            .skip(1)
            .filter_map(|rest| rest.split_once('}').map(|(var, _)| var));
        for var in reads {
            assert!(
                env.contains_key(var),
                "{name}: the config reads ${{{var}}}, which the pod does not set"
            );
        }
        let check = Command::new(bin())
            .args(["check-config", "--config"])
            .arg(&file)
            .env_clear()
            .envs(&env)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "{name}: check-config refused the ConfigMap's config: {}",
            String::from_utf8_lossy(&check.stderr)
        );
        let cfg = fencegate::config::Config::parse(&text).unwrap();

        // Ports: the named ports are the listeners'; the admin listener is open
        // to the pod network only with a token.
        let port = |n: &str| {
            c["ports"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["name"] == n)
                .unwrap_or_else(|| panic!("{name}: no port {n}"))["containerPort"]
                .as_u64()
                .unwrap()
        };
        assert_eq!(port("proxy"), u64::from(cfg.server.listen.port()), "{name}");
        assert_eq!(
            port("admin"),
            u64::from(cfg.server.admin_listen.port()),
            "{name}"
        );
        assert!(
            cfg.server.admin_listen.ip().is_loopback() || env.contains_key("FENCEGATE_ADMIN_TOKEN"),
            "{name}: the admin listener is open without a token"
        );
        for (probe, path) in [
            ("livenessProbe", "/livez"),
            ("readinessProbe", "/readyz"),
            ("startupProbe", "/livez"),
        ] {
            let p = &c[probe]["httpGet"];
            assert_eq!(p["path"], path, "{name}: {probe}");
            assert_eq!(p["port"], "admin", "{name}: {probe}");
        }
        let readiness_timeout = c["readinessProbe"]["timeoutSeconds"].as_u64().unwrap();
        assert!(
            readiness_timeout > seconds(cfg.store.timeout_ms),
            "{name}: /readyz may take [store] timeout_ms"
        );

        // The grace period covers the delay, the drain, abandoning the rest
        // (2 s) and closing the admin listener (1 s), the release, and a margin.
        assert!(cfg.server.shutdown_delay_ms > 0, "{name}: a shutdown delay");
        let release = match &cfg.cluster {
            // A takeover under way (up to 5 s), releasing the rows, leaving.
            Some(_) => 5 + 2 * seconds(cfg.state.timeout_ms),
            None => seconds(cfg.store.timeout_ms),
        };
        let needed = seconds(cfg.server.shutdown_delay_ms)
            + seconds(cfg.server.shutdown_timeout_ms)
            + 3
            + release
            + 5;
        let grace = o.pod()["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            grace >= needed,
            "{name}: terminationGracePeriodSeconds {grace} < {needed}"
        );
        assert!(
            c["lifecycle"]["preStop"].is_null(),
            "{name}: a preStop sleep would add to shutdown_delay_ms (and count against the grace period)"
        );

        // The image's user, non-root, read-only root.
        let sc = &o.pod()["securityContext"];
        assert_eq!(sc["runAsNonRoot"], true);
        assert_eq!(sc["runAsUser"].to_string(), image_uid, "{name}");
        assert_eq!(sc["runAsGroup"].to_string(), image_gid, "{name}");
        let csc = &c["securityContext"];
        assert_eq!(csc["readOnlyRootFilesystem"], true, "{name}");
        assert_eq!(csc["allowPrivilegeEscalation"], false, "{name}");
        assert!(
            c["resources"]["requests"]["cpu"].is_string()
                && c["resources"]["limits"]["memory"].is_string()
        );

        // Services select the pods and name their ports; Prometheus' annotations
        // name the admin port.
        let labels = &o.workload()["spec"]["template"]["metadata"]["labels"];
        let selects = |sel: &Value| {
            sel.as_object()
                .unwrap()
                .iter()
                .all(|(k, v)| &labels[k] == v)
        };
        assert!(selects(&o.workload()["spec"]["selector"]["matchLabels"]));
        for s in o.all("Service") {
            assert!(
                selects(&s["spec"]["selector"]),
                "{name}: {}",
                s["metadata"]["name"]
            );
            for p in s["spec"]["ports"].as_array().unwrap() {
                port(p["targetPort"].as_str().unwrap());
            }
        }
        let annotations = &o.workload()["spec"]["template"]["metadata"]["annotations"];
        assert_eq!(
            annotations["prometheus.io/port"],
            cfg.server.admin_listen.port().to_string()
        );
        assert_eq!(annotations["prometheus.io/path"], "/metrics");

        match name {
            "single" => {
                let w = o.workload();
                assert_eq!(w["kind"], "StatefulSet");
                assert_eq!(w["spec"]["replicas"], 1, "the instance guard allows one");
                assert!(cfg.cluster.is_none());
                let claim = w["spec"]["volumeClaimTemplates"][0]["metadata"]["name"].clone();
                let data = c["volumeMounts"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .find(|m| m["name"] == claim)
                    .expect("the claim is mounted");
                assert!(
                    cfg.server
                        .data_dir
                        .starts_with(data["mountPath"].as_str().unwrap()),
                    "data_dir on the volume"
                );
                let headless = o
                    .all("Service")
                    .into_iter()
                    .find(|s| s["metadata"]["name"] == w["spec"]["serviceName"])
                    .expect("the StatefulSet's Service");
                assert_eq!(headless["spec"]["clusterIP"], "None");
            }
            _ => {
                assert_eq!(o.workload()["kind"], "Deployment");
                assert!(cfg.cluster.is_some());
                assert_eq!(cfg.state.kind, fencegate::config::StateKind::Postgres);
                let pdb = o.one("PodDisruptionBudget");
                assert!(selects(&pdb["spec"]["selector"]["matchLabels"]));
                assert_eq!(pdb["spec"]["maxUnavailable"], 1);
                let rolling = &o.workload()["spec"]["strategy"]["rollingUpdate"];
                assert_eq!(
                    rolling["maxUnavailable"], 0,
                    "a new member is ready before an old one stops"
                );
            }
        }
    }
}

/// The ServiceMonitor (kept out of the kustomizations: its CRD may be absent)
/// selects each overlay's admin Service and scrapes its named port at /metrics.
#[test]
fn the_service_monitor_scrapes_each_overlays_admin_port() {
    skip_without_python!();
    let sm = &yaml_docs(&deploy_dir().join("monitoring/servicemonitor.yaml"))[0];
    assert_eq!(sm["kind"], "ServiceMonitor");
    let sel = sm["spec"]["selector"]["matchLabels"].as_object().unwrap();
    let endpoint = &sm["spec"]["endpoints"][0];
    assert_eq!(endpoint["path"], "/metrics");
    for name in ["single", "cluster"] {
        let o = Overlay::load(name);
        let matched: Vec<&Value> = o
            .all("Service")
            .into_iter()
            .filter(|s| sel.iter().all(|(k, v)| &s["metadata"]["labels"][k] == v))
            .collect();
        assert_eq!(matched.len(), 1, "{name}: the admin Service only");
        let ports = matched[0]["spec"]["ports"].as_array().unwrap();
        assert!(
            ports.iter().any(|p| p["name"] == endpoint["port"]),
            "{name}: port {}",
            endpoint["port"]
        );
    }
}

/// The paths the probes name answer 200 on a running instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_probe_paths_answer() {
    skip_without_python!();
    let mut paths = BTreeSet::new();
    for name in ["single", "cluster"] {
        let o = Overlay::load(name);
        for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
            if let Some(p) = o.container()[probe]["httpGet"]["path"].as_str() {
                paths.insert(p.to_owned());
            }
        }
    }
    let origin = Origin::start().await;
    let store = tempfile::tempdir().unwrap();
    let fg = Fencegate::start(&format!(
        "{}{}",
        dir_store_toml(store.path()),
        route_toml("billing", "billing", &origin, "")
    ));
    for path in &paths {
        let r = send(
            Request::get(fg.admin_url(path))
                .body(Full::<Bytes>::default())
                .unwrap(),
        )
        .await;
        assert_eq!(r.status, 200, "{path}");
    }
}
