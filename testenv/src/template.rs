//! The configuration files the control plane and the node are given (`testenv/templates/`),
//! filled in by name: `{{name}}` stands for a value. Nothing else in a template is special, so
//! the files read as what the components get.

use anyhow::{Result, bail};

pub(crate) const KUBECONFIG: &str = include_str!("../templates/kubeconfig.yaml");
pub(crate) const CONTAINERD: &str = include_str!("../templates/containerd.toml");
pub(crate) const CNI_BRIDGE: &str = include_str!("../templates/10-kfbr.conflist");
pub(crate) const KUBELET: &str = include_str!("../templates/kubelet-config.yaml");

/// `template` with every `{{name}}` replaced by its value. Fails when a value has no place in
/// the template or a placeholder is left without a value.
pub(crate) fn render(template: &str, values: &[(&str, &str)]) -> Result<String> {
    let mut out = template.to_string();
    for (name, value) in values {
        let placeholder = format!("{{{{{name}}}}}");
        if !out.contains(&placeholder) {
            bail!("the template has no {placeholder}");
        }
        out = out.replace(&placeholder, value);
    }
    if let Some(start) = out.find("{{") {
        let rest = &out[start..];
        bail!("no value for {}", &rest[..rest.find("}}").map_or(rest.len(), |e| e + 2)]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fills_every_placeholder() {
        assert_eq!(render("a: {{x}}\nb: {{y}} {{x}}\n", &[("x", "1"), ("y", "{two}")]).unwrap(), "a: 1\nb: {two} 1\n");
    }

    #[test]
    fn refuses_a_missing_or_unknown_value() {
        assert!(render("a: {{x}} {{y}}", &[("x", "1")]).unwrap_err().to_string().contains("{{y}}"));
        assert!(render("a: {{x}}", &[("x", "1"), ("z", "2")]).is_err());
    }

    #[test]
    fn every_template_renders() {
        let cases: [(&str, &[&str]); 4] = [
            (KUBECONFIG, &["server", "ca_data", "user", "token"]),
            (CONTAINERD, &["root", "state", "sock", "opt", "sandbox_image", "cni_conf_dir"]),
            (CNI_BRIDGE, &["pod_cidr", "ipam_dir"]),
            (KUBELET, &["cgroup_root", "node_ip", "sock", "pod_logs", "client_ca"]),
        ];
        for (template, names) in cases {
            let values: Vec<(&str, &str)> = names.iter().map(|n| (*n, "v")).collect();
            assert!(render(template, &values).is_ok(), "{template}");
        }
    }
}
