// Package deploy holds pdkit's deployment files; its tests check the
// Kubernetes manifests in kubernetes/ against the Kubernetes API types and
// against pdserve itself. It is a module of its own, so that pdkit's module
// does not depend on the Kubernetes API.
package deploy

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"
)

const manifestDir = "kubernetes"

// kustomization is the part of kustomize's Kustomization the manifests
// use; decoded strictly, a field outside it is an error.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Resources  []string `json:"resources"`
	Labels     []struct {
		Pairs map[string]string `json:"pairs"`
	} `json:"labels"`
	SecretGenerator []struct {
		Name  string   `json:"name"`
		Files []string `json:"files"`
		Type  string   `json:"type"`
	} `json:"secretGenerator"`
	GeneratorOptions struct {
		DisableNameSuffixHash bool `json:"disableNameSuffixHash"`
	} `json:"generatorOptions"`
	Images []image `json:"images"`
}

// image is a kustomize image override: the name the manifests use, the
// image it stands for.
type image struct {
	Name    string `json:"name"`
	NewName string `json:"newName"`
	NewTag  string `json:"newTag"`
}

// workload is a Deployment or StatefulSet, reduced to what the checks need.
type workload struct {
	kind, name string
	replicas   int
	selector   *metav1.LabelSelector
	pod        corev1.PodTemplateSpec
	service    string // a StatefulSet's serviceName
}

// manifests is everything kubernetes/ holds, decoded.
type manifests struct {
	kust      kustomization
	workloads []workload
	services  []corev1.Service
}

// loadManifests decodes kustomization.yaml and every resource it lists,
// each YAML document strictly into its Kubernetes API type.
func loadManifests(t *testing.T) *manifests {
	t.Helper()
	m := &manifests{}
	if err := yaml.UnmarshalStrict(readFile(t, "kustomization.yaml"), &m.kust); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	for _, res := range m.kust.Resources {
		for i, doc := range splitDocuments(readFile(t, res)) {
			if err := m.decode(doc); err != nil {
				t.Errorf("%s, document %d: %v", res, i+1, err)
			}
		}
	}
	return m
}

func readFile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(manifestDir, name))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// splitDocuments splits a multi-document YAML file at its "---" lines.
func splitDocuments(b []byte) [][]byte {
	var docs [][]byte
	for _, d := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(b), -1) {
		if strings.TrimSpace(stripComments(d)) != "" {
			docs = append(docs, []byte(d))
		}
	}
	return docs
}

func stripComments(s string) string {
	return regexp.MustCompile(`(?m)^\s*#.*$`).ReplaceAllString(s, "")
}

// decode strictly decodes one document by its apiVersion and kind.
func (m *manifests) decode(doc []byte) error {
	var tm metav1.TypeMeta
	if err := yaml.Unmarshal(doc, &tm); err != nil {
		return err
	}
	switch tm.APIVersion + " " + tm.Kind {
	case "apps/v1 Deployment":
		var d appsv1.Deployment
		if err := yaml.UnmarshalStrict(doc, &d); err != nil {
			return err
		}
		m.workloads = append(m.workloads, workload{kind: tm.Kind, name: d.Name, replicas: replicas(d.Spec.Replicas),
			selector: d.Spec.Selector, pod: d.Spec.Template})
	case "apps/v1 StatefulSet":
		var s appsv1.StatefulSet
		if err := yaml.UnmarshalStrict(doc, &s); err != nil {
			return err
		}
		m.workloads = append(m.workloads, workload{kind: tm.Kind, name: s.Name, replicas: replicas(s.Spec.Replicas),
			selector: s.Spec.Selector, pod: s.Spec.Template, service: s.Spec.ServiceName})
	case "v1 Service":
		var s corev1.Service
		if err := yaml.UnmarshalStrict(doc, &s); err != nil {
			return err
		}
		m.services = append(m.services, s)
	default:
		return fmt.Errorf("unexpected %s %s", tm.APIVersion, tm.Kind)
	}
	return nil
}

func replicas(p *int32) int {
	if p == nil {
		return 1
	}
	return int(*p)
}

// The manifests decode strictly into the Kubernetes API types: a
// misspelt or misplaced field fails here, not at kubectl apply.
func TestManifestsDecodeStrictly(t *testing.T) {
	m := loadManifests(t)
	if m.kust.APIVersion != "kustomize.config.k8s.io/v1beta1" || m.kust.Kind != "Kustomization" {
		t.Errorf("kustomization.yaml is %s %s", m.kust.APIVersion, m.kust.Kind)
	}
	if len(m.workloads) != 3 || len(m.services) != 3 {
		t.Errorf("%d workloads and %d services; want the router, prefill and decode with a Service each", len(m.workloads), len(m.services))
	}
	files, _ := filepath.Glob(filepath.Join(manifestDir, "*.yaml"))
	for _, f := range files {
		if base := filepath.Base(f); base != "kustomization.yaml" && !slices.Contains(m.kust.Resources, base) {
			t.Errorf("%s is not among kustomization.yaml's resources", base)
		}
	}
}

// The strict decoding itself refuses an unknown field.
func TestStrictDecodingRefusesUnknownFields(t *testing.T) {
	doc := []byte("apiVersion: v1\nkind: Service\nmetadata:\n  name: x\nspec:\n  selectr: {a: b}\n")
	if err := (&manifests{}).decode(doc); err == nil || !bytes.Contains([]byte(err.Error()), []byte("selectr")) {
		t.Errorf("a Service with spec.selectr decoded: %v", err)
	}
}
