package deploy

import (
	"fmt"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// secretEnv is the variable pdserve reads the cluster secret from.
const secretEnv = "PD_CLUSTER_SECRET"

// secretRoles are the roles that must hold the cluster secret: those of
// the PD plane, and the router, which signs its requests to them.
var secretRoles = []string{"prefill", "decode", "router"}

// probePaths are the HTTP health endpoints a probe may use.
var probePaths = []string{"/health", "/livez", "/readyz"}

// Each Service selects the pods of exactly one workload, and names its
// ports as that workload's containers do.
func TestServicesSelectTheirPods(t *testing.T) {
	m := loadManifests(t)
	for _, s := range m.services {
		var matched []workload
		for _, w := range m.workloads {
			if len(s.Spec.Selector) > 0 && subset(s.Spec.Selector, w.pod.Labels) {
				matched = append(matched, w)
			}
		}
		if len(matched) != 1 {
			t.Errorf("Service %s selects %d workloads; want 1", s.Name, len(matched))
			continue
		}
		w := matched[0]
		for _, p := range s.Spec.Ports {
			if p.TargetPort.Type != intstr.String || p.TargetPort.StrVal != p.Name {
				t.Errorf("Service %s port %s targets %q; want the container port of the same name", s.Name, p.Name, p.TargetPort.String())
			}
			if cp, ok := containerPort(w, p.Name); !ok || cp != p.Port {
				t.Errorf("Service %s port %s is %d; %s %s's container port %s is %d", s.Name, p.Name, p.Port, w.kind, w.name, p.Name, cp)
			}
		}
	}
	for _, w := range m.workloads {
		if w.selector == nil || !subset(w.selector.MatchLabels, w.pod.Labels) {
			t.Errorf("%s %s: its selector does not match its pod labels", w.kind, w.name)
		}
		if w.kind == "StatefulSet" {
			s := service(m, w.service)
			if s == nil || s.Spec.ClusterIP != corev1.ClusterIPNone || !subset(s.Spec.Selector, w.pod.Labels) {
				t.Errorf("StatefulSet %s: serviceName %q is not a headless Service selecting its pods", w.name, w.service)
			}
		}
	}
}

// Every container is probed on a health endpoint, scraped by Prometheus on
// one of its ports and requests resources; the PD servers read the cluster
// secret from the Secret kustomize generates.
func TestContainersAreProbedScrapedAndGivenTheSecret(t *testing.T) {
	m := loadManifests(t)
	secret, key := generatedSecret(t, m.kust)
	for _, w := range m.workloads {
		a := w.pod.Annotations
		if a["prometheus.io/scrape"] != "true" || a["prometheus.io/path"] != "/metrics" {
			t.Errorf("%s: prometheus.io annotations %v; want scrape true on /metrics", w.name, a)
		}
		for _, c := range w.pod.Spec.Containers {
			what := w.name + "/" + c.Name
			if port, err := strconv.Atoi(a["prometheus.io/port"]); err != nil || !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return int(p.ContainerPort) == port && p.Name == "http" }) {
				t.Errorf("%s: prometheus.io/port %q is not its http port", what, a["prometheus.io/port"])
			}
			checkProbe(t, what+" readinessProbe", c, c.ReadinessProbe, true)
			checkProbe(t, what+" livenessProbe", c, c.LivenessProbe, false)
			if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() {
				t.Errorf("%s: no CPU or memory request", what)
			}
			if len(c.Args) > 0 && slices.Contains(secretRoles, c.Args[0]) {
				checkSecretEnv(t, what, c, secret, key)
			}
			if !slices.ContainsFunc(m.kust.Images, func(i image) bool { return i.Name == c.Image }) {
				t.Errorf("%s: image %q is not among kustomization.yaml's images", what, c.Image)
			}
		}
	}
}

// checkSecretEnv checks that c reads the cluster secret from key of the
// Secret name.
func checkSecretEnv(t *testing.T, what string, c corev1.Container, name, key string) {
	t.Helper()
	e := envVar(c, secretEnv)
	if e == nil || e.ValueFrom == nil || e.ValueFrom.SecretKeyRef == nil || e.ValueFrom.SecretKeyRef.Name != name || e.ValueFrom.SecretKeyRef.Key != key {
		t.Errorf("%s: %s is not the Secret %s's key %s", what, secretEnv, name, key)
	}
}

// checkProbe checks that a probe exists and asks a health endpoint on a
// named container port (a liveness probe may also just connect).
func checkProbe(t *testing.T, what string, c corev1.Container, p *corev1.Probe, httpOnly bool) {
	t.Helper()
	switch {
	case p == nil:
		t.Errorf("%s missing", what)
	case p.HTTPGet != nil:
		if !slices.Contains(probePaths, p.HTTPGet.Path) {
			t.Errorf("%s asks %s; want one of %v", what, p.HTTPGet.Path, probePaths)
		}
		if _, ok := namedPort(c, p.HTTPGet.Port.StrVal); !ok {
			t.Errorf("%s asks port %q, not a named port of the container", what, p.HTTPGet.Port.String())
		}
	case p.TCPSocket != nil && !httpOnly:
		if _, ok := namedPort(c, p.TCPSocket.Port.StrVal); !ok {
			t.Errorf("%s connects to port %q, not a named port of the container", what, p.TCPSocket.Port.String())
		}
	default:
		t.Errorf("%s is neither an HTTP health check nor a TCP connect", what)
	}
}

// generatedSecret is the name and key of the cluster secret kustomize
// generates (a files entry KEY=PATH, or PATH whose base name is the key).
func generatedSecret(t *testing.T, k kustomization) (name, key string) {
	t.Helper()
	if len(k.SecretGenerator) != 1 || len(k.SecretGenerator[0].Files) != 1 {
		t.Fatalf("kustomization.yaml: want one secretGenerator of one file, the cluster secret")
	}
	if !k.GeneratorOptions.DisableNameSuffixHash {
		t.Error("kustomization.yaml: the generated Secret's name must stay fixed (disableNameSuffixHash) for secretKeyRef to find it")
	}
	g := k.SecretGenerator[0]
	key, path, ok := strings.Cut(g.Files[0], "=")
	if !ok {
		key, path = filepath.Base(g.Files[0]), g.Files[0]
	}
	ignore, err := os.ReadFile(".gitignore")
	if err != nil || !strings.Contains(string(ignore), "/"+filepath.ToSlash(filepath.Join(manifestDir, path))) {
		t.Errorf("the secret file %s is not ignored by deploy/.gitignore", path)
	}
	return g.Name, key
}

// Every container argument is a flag that pdserve's command for the role
// accepts, every PD_* variable one it reads, and the addresses the
// servers give each other agree: the router's server lists, the decode's
// prefill registries, what each StatefulSet pod advertises.
func TestArgsAreFlagsOfPdserve(t *testing.T) {
	m := loadManifests(t)
	for _, w := range m.workloads {
		for _, c := range w.pod.Spec.Containers {
			if len(c.Args) == 0 {
				t.Errorf("%s/%s: no args (the role comes first)", w.name, c.Name)
				continue
			}
			role := c.Args[0]
			if want := w.pod.Labels["app.kubernetes.io/component"]; role != want {
				t.Errorf("%s/%s runs pdserve %s; its component label says %s", w.name, c.Name, role, want)
			}
			help := pdserveHelp(t, role)
			for _, name := range flagNames(t, w.name, c.Args[1:]) {
				if !slices.Contains(help.flags, name) {
					t.Errorf("%s/%s: pdserve %s has no flag --%s", w.name, c.Name, role, name)
				}
			}
			for _, e := range c.Env {
				if strings.HasPrefix(e.Name, "PD_") && !regexp.MustCompile(`\b`+e.Name+`\b`).MatchString(help.text) {
					t.Errorf("%s/%s: pdserve %s reads no %s", w.name, c.Name, role, e.Name)
				}
			}
			for _, ref := range regexp.MustCompile(`\$\(([A-Z_]+)\)`).FindAllStringSubmatch(strings.Join(c.Args, " "), -1) {
				if e := envVar(c, ref[1]); e == nil || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil {
					t.Errorf("%s/%s: args refer to $(%s), which no downward-API variable sets", w.name, c.Name, ref[1])
				}
			}
		}
	}
}

func TestServersNameEachOtherConsistently(t *testing.T) {
	m := loadManifests(t)
	router, prefill, decode := byRole(t, m, "router"), byRole(t, m, "prefill"), byRole(t, m, "decode")
	checkList(t, "router --prefill", flagValues(router, "prefill"), podURLs(prefill, flagValue(t, prefill, "port")))
	checkList(t, "router --decode", flagValues(router, "decode"), podURLs(decode, flagValue(t, decode, "port")))
	checkList(t, "decode --prefill-bootstrap", flagValues(decode, "prefill-bootstrap"), podURLs(prefill, flagValue(t, prefill, "bootstrap-port")))
	for _, w := range []workload{prefill, decode} {
		c := w.pod.Spec.Containers[0]
		if got, want := flagValue(t, w, "advertise-host"), "$(POD_NAME)."+w.service; got != want {
			t.Errorf("%s --advertise-host %q; want %q, the pod's DNS name", w.name, got, want)
		}
		if e := envVar(c, "POD_NAME"); e == nil || e.ValueFrom == nil || e.ValueFrom.FieldRef == nil || e.ValueFrom.FieldRef.FieldPath != "metadata.name" {
			t.Errorf("%s: POD_NAME is not the pod's name", w.name)
		}
		for flag, port := range map[string]string{"port": "http", "bootstrap-port": "bootstrap"} {
			if v := flagValues(w, flag); len(v) == 1 {
				if cp, ok := namedPort(c, port); !ok || strconv.Itoa(int(cp)) != v[0] {
					t.Errorf("%s --%s %s; its container port %s is %d", w.name, flag, v[0], port, cp)
				}
			}
		}
	}
}

// podURLs are the base URLs of a StatefulSet's pods at port: their stable
// DNS names under its headless Service.
func podURLs(w workload, port string) []string {
	var urls []string
	for i := range w.replicas {
		urls = append(urls, fmt.Sprintf("http://%s-%d.%s:%s", w.name, i, w.service, port))
	}
	return urls
}

func checkList(t *testing.T, what string, got, want []string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Errorf("%s %v; want %v", what, got, want)
	}
}

func byRole(t *testing.T, m *manifests, role string) workload {
	t.Helper()
	for _, w := range m.workloads {
		if w.pod.Labels["app.kubernetes.io/component"] == role {
			return w
		}
	}
	t.Fatalf("no %s workload", role)
	return workload{}
}

// flagNames are the names of the flags in args (--name or --name=value).
func flagNames(t *testing.T, what string, args []string) []string {
	var names []string
	for _, a := range args {
		name, ok := strings.CutPrefix(a, "--")
		if !ok {
			t.Errorf("%s: argument %q is not a --flag=value", what, a)
			continue
		}
		name, _, _ = strings.Cut(name, "=")
		names = append(names, name)
	}
	return names
}

// flagValues are the values of every --name=V in w's first container's
// args, comma-separated lists split.
func flagValues(w workload, name string) []string {
	var vals []string
	for _, a := range w.pod.Spec.Containers[0].Args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			vals = append(vals, strings.Split(v, ",")...)
		}
	}
	return vals
}

func flagValue(t *testing.T, w workload, name string) string {
	t.Helper()
	v := flagValues(w, name)
	if len(v) != 1 {
		t.Fatalf("%s: --%s given %d times; want once", w.name, name, len(v))
	}
	return v[0]
}

func subset(sel, labels map[string]string) bool {
	for k, v := range sel {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func service(m *manifests, name string) *corev1.Service {
	for i := range m.services {
		if m.services[i].Name == name {
			return &m.services[i]
		}
	}
	return nil
}

func namedPort(c corev1.Container, name string) (int32, bool) {
	for _, p := range c.Ports {
		if p.Name == name {
			return p.ContainerPort, true
		}
	}
	return 0, false
}

func containerPort(w workload, name string) (int32, bool) {
	for _, c := range w.pod.Spec.Containers {
		if p, ok := namedPort(c, name); ok {
			return p, true
		}
	}
	return 0, false
}

func envVar(c corev1.Container, name string) *corev1.EnvVar {
	for i := range c.Env {
		if c.Env[i].Name == name {
			return &c.Env[i]
		}
	}
	return nil
}

// help is what pdserve ROLE --help says: its text and its flags' names.
type help struct {
	text  string
	flags []string
}

var (
	helpMu    sync.Mutex
	helpCache = map[string]help{}
	pdserve   string // built or given once per test binary
	binDir    string // where TestMain lets pdserve be built
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "pdkit-deploy-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// pdserveHelp runs pdserve ROLE --help: $PDSERVE when set, else pdserve
// built from the module above.
func pdserveHelp(t *testing.T, role string) help {
	t.Helper()
	helpMu.Lock()
	defer helpMu.Unlock()
	if h, ok := helpCache[role]; ok {
		return h
	}
	out, err := exec.Command(pdserveBinary(t), role, "--help").CombinedOutput()
	if err != nil {
		t.Fatalf("pdserve %s --help: %v\n%s", role, err, out)
	}
	names := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)`).FindAllStringSubmatch(string(out), -1) {
		names[m[1]] = true
	}
	h := help{text: string(out), flags: slices.Sorted(maps.Keys(names))}
	helpCache[role] = h
	return h
}

// pdserveBinary is $PDSERVE when set, else pdserve built once from the
// module above (make test builds it there first, so this is a cache hit).
func pdserveBinary(t *testing.T) string {
	t.Helper()
	if pdserve != "" {
		return pdserve
	}
	if p := os.Getenv("PDSERVE"); p != "" {
		pdserve = p
		return p
	}
	bin := filepath.Join(binDir, "pdserve")
	cmd := exec.Command("go", "build", "-o", bin, "./cmd/pdserve")
	cmd.Dir = ".."
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/pdserve: %v\n%s", err, out)
	}
	pdserve = bin
	return bin
}
